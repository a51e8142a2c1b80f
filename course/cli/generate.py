"""`kvcourse generate "PROMPT"`: stream one answer, then report time to first token and inter-token latency."""
from __future__ import annotations

import sys


def add_arguments(p):
    p.add_argument("prompt", help="what to ask the model")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--model", default=None, help="path to another Llama-family GGUF file")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")


def run(args) -> int:
    import course
    from course.engine.sampling import check_params
    from course.engine.streaming import stream_answer

    try:
        check_params(args.temperature, args.top_k, args.top_p)
        model, tok = course.load(args.model, device=args.device, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        g = stream_answer(model, tok, args.prompt, args.max_new_tokens, raw=args.raw,
                          write=lambda s: (sys.stdout.write(s), sys.stdout.flush()), temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(f"\n[{len(g.prompt_ids)} prompt tokens, {len(g.tokens)} new tokens, stop: {g.stop_reason}]  "
          f"TTFT {g.time_to_first_token * 1e3:.0f} ms  ·  mean ITL {g.mean_inter_token_latency * 1e3:.1f} ms/token  "
          f"({g.decode_tokens_per_s:.1f} tokens/s)  on {model.device} {str(model.dtype).split('.')[-1]}")
    return 0
