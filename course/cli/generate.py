"""`kvcourse generate "PROMPT"`: stream one answer, then report time to first token and inter-token latency."""
from __future__ import annotations

import sys

from course.cli.args import gguf_file, non_negative_int, positive_int, seed, temperature, top_p, utf8_text


def add_arguments(p):
    p.add_argument("prompt", type=utf8_text, help="what to ask the model (UTF-8 text)")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=128,
                   help="most tokens to generate (default 128; 0 = only read the prompt); the prompt and these "
                        "must fit the model's context (its max_seq_len, checked after loading)")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=top_p, default=None)
    p.add_argument("--seed", type=seed, default=None)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--model", type=gguf_file, default=None, help="path to another Llama-family GGUF file")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")


def report(g, model) -> str:
    """The line after the answer: token counts and, when there were new tokens, TTFT and ITL."""
    head = f"[{len(g.prompt_ids)} prompt tokens, {len(g.tokens)} new tokens, stop: {g.stop_reason or 'length'}]"
    where = f"on {model.device} {str(model.dtype).split('.')[-1]}"
    if not g.tokens:  # nothing was generated: there is no first token to time
        return f"{head}  no new tokens asked for (--max-new-tokens 0), so no time to first token  {where}"
    itl = (f"mean ITL {g.mean_inter_token_latency * 1e3:.1f} ms/token  ({g.decode_tokens_per_s:.1f} tokens/s)"
           if g.inter_token_latencies else "no inter-token latency (one new token)")
    return f"{head}  TTFT {g.time_to_first_token * 1e3:.0f} ms  ·  {itl}  {where}"


def run(args) -> int:
    """Bad settings and model files raise ValueError / OSError: `kvcourse` prints them on one line, exit 2."""
    import course
    from course.engine.sampling import check_params
    from course.engine.streaming import stream_answer

    check_params(args.temperature, args.top_k, args.top_p)
    model, tok = course.load(args.model, device=args.device, dtype=args.dtype)
    g = stream_answer(model, tok, args.prompt, args.max_new_tokens, raw=args.raw,
                      write=lambda s: (sys.stdout.write(s), sys.stdout.flush()), temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print()
    print("\n" + report(g, model))
    return 0
