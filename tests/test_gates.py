"""Physics gates and the one machine profile: a number physics forbids never reaches a sentence."""
from __future__ import annotations

import json
import time

import pytest

from course.measure import gates, machine, results
from course.measure.display import Report, verdict


def test_each_rule_passes_what_is_possible_and_names_what_is_not():
    assert gates.batch_gain(8, 7.9) is None
    assert "more than 8×" in gates.batch_gain(8, 15.5)
    assert gates.not_below_floor(31.0, 12.0) is None
    assert "under its 12.0 ms bandwidth floor" in gates.not_below_floor(9.0, 12.0)
    assert gates.not_cheaper(68.7, 70.0, "B = 1", "B = 8") is None
    assert "less than B = 1" in gates.not_cheaper(68.7, 35.4, "B = 1", "B = 8")
    assert gates.at_least(0.5, 0.03, "TTFT", "one decode step") is None
    assert gates.at_least(0.01, 0.03, "TTFT", "one decode step")


def test_a_violation_is_measured_again_then_flagged_and_kept_out_of_the_record(monkeypatch):
    monkeypatch.setattr(results, "_recorded", {})
    monkeypatch.delenv("KVCOURSE_RESULTS", raising=False)
    monkeypatch.setattr(gates, "busy_cores", lambda: 1.6)
    gains = iter([15.5, 14.0, 12.0])
    run = gates.measured(lambda: next(gains), lambda g: [gates.batch_gain(8, g)], "the batch gain")
    assert not run.ok and run.tries == 3 and run.value == 12.0
    assert "1.6 of" in run.notice and "the batch gain is unreliable" in run.notice
    assert all(len(sentence.split()) <= 35 for sentence in run.notice.split(". "))
    assert results.record_gated("batch_gain", run) is None
    assert "batch_gain" not in results.recorded() and results.recorded()["unreliable"] == ["batch_gain"]

    monkeypatch.setattr(gates, "busy_cores", lambda: 0.1)  # quiet: the notice must not call the machine busy
    run = gates.measured(lambda: 9.0, lambda ms: [gates.not_below_floor(ms, 12.0)], "the compiled step", tries=2)
    assert not run.ok and run.quiet and "busy" not in run.notice + run.headline("")
    assert "under its 12.0 ms bandwidth floor" in run.notice and "Other programs were quiet" in run.notice
    assert run.headline("") == "Not used: the compiled step broke a physical limit. Re-run."

    gains = iter([15.5, 7.5])  # a burst of load passes: the second try is kept
    run = gates.measured(lambda: next(gains), lambda g: [gates.batch_gain(8, g)], "the batch gain")
    assert run.ok and run.tries == 2 and run.notice == ""
    assert results.record_gated("batch_gain", run) == 7.5 and results.recorded()["batch_gain"] == 7.5


def test_report_headline_is_short_and_details_fold_away(monkeypatch):
    monkeypatch.setattr(results, "_recorded", {})
    monkeypatch.delenv("KVCOURSE_RESULTS", raising=False)
    ok, words = verdict(10.0, 12.0, 0.25)
    assert ok and "within ±25%" in words
    ok, words = verdict(10.0, 13.1, 0.25)
    assert not ok and "31% above" in words
    r = Report([("ms per token", 10.0, None, "ms")], f"Decode: {words}.", ["probe 16 to 18 GB/s"], key="decode")
    assert "—" in str(r) and "<details><summary>How sure is this?" in r._repr_html_()
    assert results.recorded()["headlines"] == {"decode": f"Decode: {words}."}
    with pytest.raises(ValueError, match="at most 30 words"):
        Report([], " ".join(["word"] * 31))


def test_the_profile_is_measured_once_and_then_shared(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    monkeypatch.delenv("KVCOURSE_THREADS", raising=False)
    calls = []

    def fake_measure(model, device, dtype, tries=3):
        calls.append(1)
        return machine.Profile("cpu", dtype, 1, 2, 20.0, 100.0, 0.1, time.time(), host=machine._host(
            __import__("torch").device("cpu")))

    monkeypatch.setattr(machine, "measure_profile", fake_measure)
    first = machine.profile(dtype="float32")
    again = machine.profile(dtype="float32")
    assert len(calls) == 1 and again.bandwidth_gb_s == first.bandwidth_gb_s == 20.0
    saved = json.loads((tmp_path / "machine.json").read_text())
    assert saved["cpu/float32"]["bandwidth_gb_s"] == 20.0
    assert machine.profile(dtype="float32", refresh=True) and len(calls) == 2
    assert first.floor_ms(20e9 * 0.012) == pytest.approx(12.0)

    stale = dict(saved["cpu/float32"], measured_at=time.time() - machine.STALE_AFTER_S - 1)
    (tmp_path / "machine.json").write_text(json.dumps({"cpu/float32": stale}))
    machine.profile(dtype="float32")
    assert len(calls) == 3  # older than a week: measured again
    (tmp_path / "machine.json").write_text("not json")
    machine.profile(dtype="float32")
    assert len(calls) == 4  # an unreadable file is measured over, never a crash


def test_the_gate_floor_uses_the_fastest_read_seen():
    from course.measure import timing

    quiet = machine.Profile("cpu", "float32", 2, 2, 32.0, 100.0, 0.0, time.time())
    assert quiet.gate_floor_ms(640e6) == pytest.approx(20.0)  # 640 MB at the profile's 32 GB/s
    probe = timing.ReadProbe("cpu", nbytes=8 << 20, repeats=1)
    read = probe()
    assert timing.fastest_read("cpu") == read and timing.fastest_read("cuda") == 0.0
    timing._fastest["cpu"] = 40e9  # memory read faster beside the step than when the profile was taken: lower floor
    assert quiet.gate_floor_ms(640e6) == pytest.approx(16.0)
    again = probe()  # the fastest read is kept: a slower one later never raises the floor again
    assert timing.fastest_read("cpu") == max(40e9, read, again)
    timing._fastest["cpu"] = 20e9
    assert quiet.gate_floor_ms(640e6) == pytest.approx(20.0)
    assert machine.Profile("cpu", "float32", 2, 2, 32.0, 100.0, 1.5, time.time()).gate_floor_ms(640e6) == 0.0


def test_a_profile_taken_busy_is_kept_until_the_machine_is_quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    monkeypatch.delenv("KVCOURSE_THREADS", raising=False)
    import torch

    busy = machine.Profile("cpu", "float32", 1, 2, 5.0, 50.0, 1.5, time.time() - 60,
                           host=machine._host(torch.device("cpu")))
    machine.save(busy)
    monkeypatch.setattr(machine, "measure_profile", lambda *a, **k: machine.Profile(
        "cpu", "float32", 1, 2, 20.0, 100.0, 0.0, time.time(), host=busy.host))
    monkeypatch.setattr(machine.threads, "sample_others", lambda *a: 1.5)
    assert machine.profile(dtype="float32").bandwidth_gb_s == 5.0  # still busy: every lesson quotes the same
    monkeypatch.setattr(machine.threads, "sample_others", lambda *a: 0.0)
    assert machine.profile(dtype="float32").bandwidth_gb_s == 5.0  # quiet, but the same sitting: kept
    machine.save(machine.Profile(**{**busy.__dict__, "measured_at": time.time() - machine.BUSY_KEPT_S - 1}))
    assert machine.profile(dtype="float32").bandwidth_gb_s == 20.0  # quiet, hours later: measured again


def test_eager_decode_is_timed_on_the_tiny_model(tiny):
    ms = machine.eager_decode_ms(tiny, context=4, repeats=3)
    assert 0 < ms < 5000


def test_a_flagged_figure_is_shown_as_a_dash_and_its_notice_recorded_once(fresh_progress):
    from course.measure import gates
    from course.measure.results import record_gated, recorded

    ok = gates.measured(lambda: 5.0, lambda v: [], "a figure")
    assert ok.shown(5.0) == 5.0 and ok.headline("5 ms, as predicted.") == "5 ms, as predicted."
    bad = gates.measured(lambda: 5.0, lambda v: [gates.not_below_floor(v, 10.0)], "the step time", tries=1)
    assert bad.shown(5.0) is None and bad.headline("5 ms, as predicted.").startswith("Not used: the step time")
    for key in ("step_ms", "step_ratio"):  # two figures of one flagged measurement: one notice
        record_gated(key, bad, 5.0)
    assert recorded()["unreliable"] == ["step_ms", "step_ratio"] and recorded()["busy_notices"] == [bad.notice]


@pytest.mark.slow  # loads the real model three times
def test_doctor_shows_the_saved_profile_and_measures_it_again_when_asked(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    import torch

    from course.cli import doctor

    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    monkeypatch.delenv("KVCOURSE_MACHINE", raising=False)
    calls = []

    def fake_measure(model, device, dtype, tries=3):
        calls.append(dtype)
        return machine.Profile("cpu", dtype, 1, 2, 20.0 + len(calls), 100.0, 0.1, time.time(),
                               host=machine._host(torch.device("cpu")), decode_ms={"eager": 50.0})

    monkeypatch.setattr(machine, "measure_profile", fake_measure)
    assert doctor.run(SimpleNamespace(quick=False, device="cpu", profile=False)) == 0
    assert "measuring this machine" in capsys.readouterr().out and calls == ["float32"]
    assert doctor.run(SimpleNamespace(quick=False, device="cpu", profile=False)) == 0
    out = capsys.readouterr().out
    assert "memory 21.0 GB/s" in out and "measuring" not in out and len(calls) == 1, out  # the saved one
    assert doctor.run(SimpleNamespace(quick=False, device="cpu", profile=True)) == 0
    assert "memory 22.0 GB/s" in capsys.readouterr().out and len(calls) == 2
    assert json.loads((tmp_path / "machine.json").read_text())["cpu/float32"]["bandwidth_gb_s"] == 22.0


def test_a_machine_profile_edited_by_hand_is_as_good_as_none(tmp_path, monkeypatch):
    from dataclasses import asdict

    import torch

    monkeypatch.setenv("KVCOURSE_MACHINE", str(tmp_path / "machine.json"))
    monkeypatch.delenv("KVCOURSE_THREADS", raising=False)
    prof = machine.Profile("cpu", "float32", torch.get_num_threads(), 2, 5.0, 10.0, 0.1, time.time(),
                           host=machine._host(torch.device("cpu")))
    machine.save(prof)
    assert machine.load("cpu", "float32") == prof
    for bad in ([1, 2], {"cpu/float32": [1]}, {"cpu/float32": {**asdict(prof), "measured_at": "yesterday"}},
                {"cpu/float32": {**asdict(prof), "colour": "red"}}):
        (tmp_path / "machine.json").write_text(json.dumps(bad))
        assert machine.load("cpu", "float32") is None, bad
