"""What a learner reads: notebook prose, code and outputs, quiz text. Used by the lesson and quiz tests.

"Seed" has two senses. A random-number seed (``seed=0``, "a new seed", "pin a random seed") is fine in
learner text. The other sense, the source lesson this course was written from, must not reach learners:
they never saw it, so the course names its real sources instead (papers, posts, docs). The check is a
whitelist: every "seed" must sit in one of the random-number phrasings below, or it is reported.
"""
from __future__ import annotations

import re

_RNG_SEED = re.compile(
    r"seed\s*=|seed\s+\d|seed\)|seeded|manual_seed|--seed|"
    r"\b(?:a|new|random|same|fixed|different|its|own|the RNG|generator) seed\b|"
    r"\bseed (?:pins|fixes|helps|shown|repeats|argument)\b", re.I)
_ANY_SEED = re.compile(r"\bseeds?\b|seed(?:'s|_)", re.I)


def source_sense_seeds(text: str) -> list[str]:
    """The places in `text` where "seed" is not a random-number seed, each with some context."""
    cleaned = _RNG_SEED.sub(lambda m: "#" * len(m.group()), text)
    return [text[max(0, m.start() - 40): m.end() + 40].replace("\n", " ") for m in _ANY_SEED.finditer(cleaned)]


def notebook_text(nb, outputs: bool = True) -> str:
    """Every cell's source, plus (when `outputs`) every text output and error a run left in it."""
    parts = []
    for cell in nb.cells:
        parts.append(cell.source)
        for out in cell.get("outputs", []) if outputs else []:
            if "text" in out:
                parts.append(out["text"] if isinstance(out["text"], str) else "".join(out["text"]))
            for mime in ("text/plain", "text/markdown", "text/html"):
                data = out.get("data", {}).get(mime)
                if data:
                    parts.append(data if isinstance(data, str) else "".join(data))
    return re.sub(r"[ \t]*\n[ \t]*", "\n", re.sub(r"[ \t]+", " ", "\n".join(parts)))


def flat(text: str) -> str:
    """Whitespace collapsed, so a check does not depend on where a printed sentence was wrapped."""
    return " ".join(text.split())


def quiz_text(bank) -> str:
    """Everything a learner can read in the question bank: prompts, options, explanations, cards."""
    parts = []
    for q in bank.questions:
        parts.append(q.prompt)
        parts += [t for o in q.options for t in (o.text, o.explanation)]
    parts += [t for c in bank.cards for t in (c.prompt, c.answer)]
    parts += [t for lesson in bank.lessons.values() for t in
              ((lesson.get("title"), lesson.get("self_assessment")) if isinstance(lesson, dict)
               else (getattr(lesson, "title", ""), getattr(lesson, "self_assessment", "")))]
    return "\n".join(t for t in parts if t)


def executed(tmp_path, stem: str):
    """The executed copy tests/notebook_runner.py left for lesson `stem` in `tmp_path`."""
    import nbformat

    return nbformat.read(tmp_path / f"{stem}-executed.ipynb", as_version=4)


def assert_learner_output_clean(nb, results: dict, lesson: str, min_bullets: int = 4):
    """After a headless run: no source-sense 'seed' anywhere a learner reads, and a recap that quotes
    this run (it was recorded, shows at least `min_bullets` numbers, and each was shown as 'label: value')."""
    text = notebook_text(nb)
    assert source_sense_seeds(text) == [], source_sense_seeds(text)
    assert "Traceback" not in text
    recap = results.get("recap")
    assert recap and recap["lesson"] == lesson, recap
    assert len(recap["numbers"]) >= min_bullets, recap["numbers"]
    assert recap["next"], "the recap links to no next lesson"
    shown = flat(text)
    for label, value in recap["numbers"].items():
        assert flat(f"{label}: {value}") in shown, f"recap number not shown: {label}: {value}"


def assert_reads_cleanly(nb, results: dict, lesson: str, next_lesson: str, min_numbers: int = 4):
    """What every lesson run owes a learner: no printed sentence over 35 words, no deferral to another printout,
    no Traceback or source-sense 'seed', and a recap with its numbers that links on to `next_lesson`."""
    assert long_sentences(nb, 35) == [] and deferrals(nb) == []
    assert_learner_output_clean(nb, results, lesson, min_numbers)
    assert results["recap"]["next"] == next_lesson


def stated_run_minutes(nb) -> float:
    """The bound the lesson's first cell states: '**Run time:** under N minutes' (N may be 2.5)."""
    from bench.course_checks import stated_run_minutes as stated

    minutes = stated(nb)
    assert minutes is not None, "the first cell must state '**Run time:** under N minutes'"
    return minutes


def load_factor() -> float:
    """How oversubscribed the machine was over the last 5 minutes: load average ÷ cores, at least 1.

    The lessons state their run time on a quiet machine; on a shared one every process waits its turn,
    so the tests allow the stated time multiplied by this factor (and print both)."""
    import os

    try:
        return max(1.0, os.getloadavg()[1] / (os.cpu_count() or 1))
    except (AttributeError, OSError):
        return 1.0


def cell_times(cells) -> list[tuple]:
    """(started, replied, source) of every cell whose run times the notebook holds (nbclient records them, and
    JupyterLab with recordTiming on), as aware datetimes; `cells` as nbformat nodes or plain JSON dicts."""
    import datetime as dt

    times = []
    for cell in cells:
        ex = cell["metadata"].get("execution", {})
        if "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            t0, t1 = (dt.datetime.fromisoformat(ex[k].replace("Z", "+00:00"))
                      for k in ("iopub.execute_input", "shell.execute_reply"))
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            times.append((t0, t1, source))
    return times


def check_run_time(nb_path, elapsed: float, executed_nb=None) -> str:
    """Report the lesson's run time against its stated bound (scaled by the load), with the slowest cells.

    Speed is the benchmarks' business (`kvcourse bench` checks each lesson against its stated bound, side by side
    in one run); a shared test machine's timing would make this test flaky. KVCOURSE_STRICT_TIMES=1 asserts it,
    on a run of the lesson alone (tests/notebook_runner.py: lesson_run)."""
    import os

    import nbformat

    minutes = stated_run_minutes(nbformat.read(nb_path, as_version=4))
    factor = load_factor()
    slow = sorted((((t1 - t0).total_seconds(), (source.splitlines() or [""])[0][:40])
                   for t0, t1, source in cell_times(executed_nb.cells if executed_nb else [])), reverse=True)
    report = (f"{nb_path.name}: Run All took {elapsed:.0f} s, bound {minutes:g} min × load factor {factor:.1f}; "
              f"slowest cells: " + "; ".join(f"{s:.0f} s {name!r}" for s, name in slow[:4]))
    print(report)
    if os.environ.get("KVCOURSE_STRICT_TIMES", "0") not in ("", "0"):
        assert elapsed <= 60 * minutes * factor, report
    return report


def printed_text(nb) -> list[str]:
    """What the code cells printed or displayed, as a learner reads it: stream text, and of each displayed
    result its plain text (or its HTML with the tags taken out, where it has no plain text). Figures and
    widgets are left out."""
    import html as html_lib

    parts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append(out["text"] if isinstance(out["text"], str) else "".join(out["text"]))
            data = out.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                continue
            for mime in ("text/plain", "text/markdown", "text/html"):
                if mime in data:
                    text = data[mime] if isinstance(data[mime], str) else "".join(data[mime])
                    if mime == "text/html":
                        text = html_lib.unescape(re.sub(r"<[^>]+>", "\n", text))
                    parts.append(text)
                    break
    return parts


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'“])|\n")


def long_sentences(nb, limit: int = 35) -> list[str]:
    """Every printed sentence of more than `limit` words (a line with no full stop counts as one sentence)."""
    found = []
    for text in printed_text(nb):
        for sentence in _SENTENCE_END.split(text):
            if len(sentence.split()) > limit:
                found.append(" ".join(sentence.split()))
    return found


def deferrals(nb) -> list[str]:
    """Places that send the learner to read another printout instead of saying the thing ("the line above says")."""
    text = "\n".join(printed_text(nb)) + "\n" + "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return [m.group(0) for m in re.finditer(r"(?:the|a) (?:line|lines|printout|verdict|sentence)s? above (?:says|say|tells|shows)[^.\n]*", text, re.I)]


def check_timed_lesson(nb, results: dict, timed=(), profile_file=None) -> tuple[str, set]:
    """What every timed lesson's run must pass: no printed sentence over 35 words, no deferral, no Traceback, no
    source-sense 'seed'; a headline of at most 30 words, shown, for each Report key in `timed`; every busy notice
    shown; no figure flagged unreliable recorded (so no quiz or review card quotes it) or in the recap; the profile
    it quotes is the one saved (in `profile_file`, default the test run's). Returns what was shown (whitespace
    collapsed) and the unreliable keys."""
    import json

    from course.measure import machine

    text = notebook_text(nb)
    assert source_sense_seeds(text) == [] and "Traceback" not in text
    assert long_sentences(nb, 35) == [] and deferrals(nb) == []
    headlines = results["headlines"]
    assert set(timed) <= set(headlines) and all(len(h.split()) <= 30 for h in headlines.values()), headlines
    shown = flat(" ".join(printed_text(nb)))
    assert all(flat(h) in shown for h in headlines.values())
    assert all(flat(notice) in shown for notice in results.get("busy_notices", []))
    unreliable = set(results.get("unreliable", []))
    assert not unreliable & set(results) and not unreliable & set(results["recap"].get("keys", []))
    profile = results["profile"]
    saved = json.loads((profile_file or machine.path()).read_text())[f"{profile['device']}/{profile['dtype']}"]
    assert all(profile[k] == saved[k] for k in ("bandwidth_gb_s", "gflop_s", "threads")), (profile, saved)
    return shown, unreliable
