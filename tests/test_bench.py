"""The benchmark suite (bench/): it runs, writes valid JSON and Markdown, and never reports a fallback as the real
thing. Speed is never asserted. The smoke test runs `kvcourse bench --quick` on the random tiny model (seconds)."""
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import ITEMS, cli, core
from bench.core import Item, paired_ratio, refused
from course.cli import main
from course.engine.model import tiny_model
from course.measure.costs import prefill_flops

ITEM_ROW_KEYS = {
    "decode": {"engine", "dtype", "context", "batch", "ms_per_token", "tokens_per_s", "bytes_per_step",
               "achieved_bytes_per_s", "roofline_ms", "x_roofline", "fraction_of_bandwidth", "repeats"},
    "prefill": {"dtype", "tokens", "seconds", "tokens_per_s", "flops", "achieved_flops_per_s",
                "matmul_flops_per_s", "fraction_of_matmul_flops", "repeats"},
    "decode_floor": {"threads", "engine", "ms_per_step", "floor_ms", "x_floor", "x_floor_rounds", "read_rounds"},
    "decode_batch": {"threads", "engine", "batch", "ms_per_step", "x_b1_time", "x_b1_tokens", "x_roofline"},
    "widgets": {"widget", "callback", "median_ms", "p90_ms", "max_ms", "moves"},
}


def _run_cli(tmp_path, *args) -> tuple[dict, str]:
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--threads", "1", "--out", str(out), *args]) == 0
    result = json.loads((out / "latest.json").read_text())
    stamped = sorted(out.glob("bench-*.json"))
    assert len(stamped) == 1 and json.loads(stamped[0].read_text()) == result
    return result, (out / "latest.md").read_text()


def check_schema(result: dict):
    """Structure and types of a bench result (never the figures' sizes)."""
    assert result["schema"] == cli.SCHEMA and set(result["items"]) == set(ITEMS)
    for key in ("started", "device", "device_name", "threads", "torch", "quick", "load_average_before", "wall_s"):
        assert key in result["meta"], key
    for name, item in result["items"].items():
        assert item["status"] in core.STATUSES, (name, item)
        if item["status"] != "ok":
            assert item["reason"], f"{name} is {item['status']} without a reason"
            continue
        for row in item.get("rows", []):
            assert ITEM_ROW_KEYS.get(name, set()) <= set(row), (name, ITEM_ROW_KEYS[name] - set(row))
    for row in result["items"]["decode"].get("rows", []):  # the bookkeeping, not the speed
        assert row["achieved_bytes_per_s"] == pytest.approx(row["bytes_per_step"] / (row["ms_per_token"] / 1e3))
        assert row["x_roofline"] == pytest.approx(1 / row["fraction_of_bandwidth"])
    assert {t["name"] for t in result["targets"]} == set(cli.TARGETS)
    for t in result["targets"]:
        assert t["met"] in (True, False, None) and (t["value"] is None or math.isfinite(t["value"]))


@pytest.mark.slow
def test_quick_suite_on_tiny_model_writes_valid_json_and_markdown(tmp_path, capsys):
    threads = torch.get_num_threads()
    result, markdown = _run_cli(tmp_path, "--model", "tiny")
    assert torch.get_num_threads() == threads  # --threads does not leak into the caller
    check_schema(result)
    items = result["items"]
    for name in ("decode", "prefill", "decode_floor", "decode_batch", "batching", "serving", "paged_memory"):
        assert items[name]["status"] == "ok", (name, items[name])
    assert {r["dtype"] for r in items["decode"]["rows"]} == {"float32", "bfloat16"}
    for slow in cli.SLOW_ITEMS:  # --quick never runs the slow items, and says so
        assert items[slow]["status"] == "skipped" and "quick" in items[slow]["reason"]
    assert items["load"]["status"] == "skipped"  # needs the course model
    assert all(t["met"] is None for t in result["targets"])  # quick sizes never claim a target
    for r in items["decode_floor"]["rows"]:  # × floor: the median of each round's step ÷ that round's own probe
        assert len(r["x_floor_rounds"]) == len(r["read_rounds"]) == core.QUICK["rounds"]
        assert min(r["ms_rounds"]) <= r["ms_per_step"] <= max(r["ms_rounds"])
    assert "| engine | dtype | context | ms/token" in markdown and "### Targets" in markdown
    assert "wrote " in capsys.readouterr().out


def test_list_names_every_item_and_runs_nothing(tmp_path, capsys):
    assert main(["bench", "--list", "--out", str(tmp_path)]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(ITEMS) and not any(tmp_path.iterdir())


def test_not_available_items_carry_no_number(monkeypatch):
    """A part of the course that is not there yet is reported, never given a figure."""
    from bench import course_checks

    monkeypatch.setattr(course_checks, "notebook_paths", lambda: [])
    monkeypatch.setattr(course_checks.util, "find_spec", lambda name: None)
    ctx = core.Context(torch.device("cpu"), core.QUICK, False, print, "tiny")
    for item in (course_checks.bench_notebooks(ctx), course_checks.bench_grading(ctx), course_checks.bench_widgets(ctx)):
        assert item["status"] in ("not available", "skipped") and item["reason"]
        assert not any(isinstance(v, float) for v in item.values())


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # refused while parsing: one line, exit 2 (tests/test_cli_fuzz.py)
        main(["bench", "--quick", "--threads", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--skip", "everything"])
    with pytest.raises(ValueError, match="model"):
        cli.run_suite(items=["decode"], quick=True, model="gpt-5")


def test_an_item_added_to_the_registry_runs_and_renders(monkeypatch):
    """ITEMS is the one registration point: a new entry runs in the suite and gets its table and target."""
    target = core.Target("probe_n", "the probe's n", ">=", 1, lambda it: (it["rows"][0]["n"], ""))
    probe = Item(lambda ctx: {"status": "ok", "rows": [{"n": 3}], "quick": ctx.quick}, "A probe",
                 columns={"n": "{n}", "twice": lambda r: r["n"] * 2}, targets=[target])
    monkeypatch.setitem(ITEMS, "probe_item", probe)
    result = cli.run_suite(items=["probe_item"], quick=True, model="tiny", log=lambda *_: None)
    assert result["items"]["probe_item"]["quick"] is True and result["items"]["decode"]["status"] == "skipped"
    markdown = cli.render_markdown(result)
    assert "A probe" in markdown and "| n | twice |" in markdown and "| 3 | 6 |" in markdown
    assert any(t["name"] == "probe_n" and t["value"] == 3 for t in result["targets"])


def test_a_compiled_engine_that_fell_back_to_eager_is_refused_not_reported():
    """The bench once labelled eager fallbacks "compiled" and met a target with them: a row whose engine is not
    what its label says carries the reason and no figure, and no target reads it."""

    class FellBack:
        compiled, fallback = False, "torch._dynamo hit its recompile limit"

    row = refused("compiled", FellBack(), threads=1)
    assert row == {"engine": "compiled", "threads": 1,
                   "refused": "compiled fell back to eager: torch._dynamo hit its recompile limit"}
    assert refused("eager", tiny_model()) is None  # an eager engine is what its label says
    from course.engine.fast import FastModel
    from course.engine.kv_cache import KVCache

    fast = FastModel(tiny_model())
    fast.step._compiled = lambda *a: (_ for _ in ()).throw(RuntimeError("hit config.recompile_limit (8)"))
    with pytest.warns(UserWarning, match="fell back to eager"):
        fast(torch.tensor([[1]]), 0, KVCache(fast.config, 1, 4))  # the real engine, after its fallback
    assert "recompile_limit" in refused("compiled", fast)["refused"] and refused("compiled", fast.step)
    item = {"status": "ok", "rows": [row, dict(engine="eager", threads=1, x_floor=2.0, ms_per_step=50.0)]}
    target = next(t for t in ITEMS["decode_floor"].targets if t.name == "compiled_1t_x_floor")
    assert target.measure(item) == (None, "not measured")
    result = {"meta": {"quick": False}, "items": {"decode_floor": item}}
    assert next(t for t in cli.evaluate_targets(result) if t["name"] == "compiled_1t_x_floor")["met"] is None


def test_prefill_flops_match_torch_flop_counter():
    """The matmul part of our FLOP count equals what torch counts for a real prefill of the tiny model."""
    model = tiny_model()
    c, T = model.config, 16
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(torch.randint(0, c.vocab_size, (1, T)), last_only=True)
    attention = 4 * c.n_layers * c.n_heads * c.head_dim * T * (T + 1) // 2  # SDPA, which the counter omits on CPU
    assert prefill_flops(c, T) - attention == counter.get_total_flops()


def test_batch_ratios_pair_each_round_so_a_drifting_machine_cancels():
    """B = 8 takes 1.4× B = 1 in every round while the machine's speed drifts from round to round (another
    tenant): within a round the two saw the same machine, so each round's ratio, and their median, is 1.4."""
    speed = [1.0, 1.6, 1.1, 2.0, 1.3]
    b1 = [[20e-3 * s] * 2 for s in speed]
    b8 = [[28e-3 * s, 28e-3 * s * 1.01] for s in speed]
    assert paired_ratio(b8, b1) == pytest.approx(1.407, abs=0.001) and paired_ratio(b1, b1) == 1.0
    b8[3] = [1.0, 1.0]  # one absurd round moves its own ratio, not the median over rounds
    assert paired_ratio(b8, b1) == pytest.approx(1.407, abs=0.001)
    with pytest.raises(ValueError, match="same rounds"):
        paired_ratio(b8, b1[:-1])
