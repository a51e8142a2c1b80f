"""The end of every lesson: the learner's own measured numbers beside the hand-written takeaways, and links.

``recap("02_kv_cache", [("cache bytes per token", "kv_bytes_per_token", "{:,} bytes")])`` reads what the
notebook record()ed in this kernel and shows, as Markdown, each number that was measured and passed its
physics gate (a figure course.measure.gates flagged is never recorded, so it cannot appear), then links to
the next lesson that exists on disk, the exercises that follow this lesson, and the review page. It records
what it showed, so the lesson tests can check it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from course.measure.results import record, recorded
from course.paths import LESSONS

EXERCISES = LESSONS.parent / "exercises"

# (lesson id = notebook stem, title shown in links, exercises that follow it: paths under exercises/)
COURSE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("00_start_here", "Start here", ()),
    ("01_prefill_decode", "Lesson 1 · One call, two phases: prefill and decode", ()),
    ("02_kv_cache", "Lesson 2 · The KV cache and its byte math",
     ("01_memory_formula/memory_formula.ipynb", "02_kv_cache/kv_cache.ipynb")),
    ("02b_kv_cache_appendix", "Lesson 2, appendix · MHA/GQA/MQA, an INT8 cache, beam search", ()),
    ("03_sampling", "Lesson 3 · Sampling: temperature, top-k, top-p",
     ("03_sampler/sampler.ipynb", "04_checkpoint_quiz/checkpoint_quiz.ipynb")),  # the quiz covers lessons 1-3
    ("04_speculative_prefix", "Lesson 4 · Speculative decoding and prefix caching", ()),
    ("05_serving", "Lesson 5 · Serving many requests at once", ("05_paged_cache/paged_cache.ipynb",)),
    ("99_course_end", "The end of the course: what you can do now", ()),
)
OPTIONAL = {"02b_kv_cache_appendix"}  # not on the main path: the main path links past it
REVIEW = "review.ipynb"


@dataclass
class Recap:
    lesson: str
    numbers: dict  # label → the measured value as shown ("31 ms/token")
    next_lesson: tuple[str, str] | None  # (file name, title)
    exercises: list[str] = field(default_factory=list)  # paths relative to the lesson folder
    review: bool = False
    empty: str = ""  # what to say when no number was shown (default: run the lesson from the top)
    keys: list[str] = field(default_factory=list)  # the recorded key behind each number shown

    def values(self) -> dict:
        return {"lesson": self.lesson, "numbers": self.numbers, "keys": self.keys, "exercises": self.exercises,
                "next": self.next_lesson[0] if self.next_lesson else None}

    def links(self) -> list[str]:
        out = []
        if self.exercises:
            names = ", ".join(f"[{Path(p).stem.replace('_', ' ')}]({p})" for p in self.exercises)
            out.append(f"**Exercise{'s' if len(self.exercises) > 1 else ''} for this lesson:** {names}")
        if self.next_lesson:
            out.append(f"**Next:** [{self.next_lesson[1]}]({self.next_lesson[0]})")
        if self.review:
            out.append(f"**Come back later:** [review the questions you found hard]({REVIEW})")
        return out

    def _lines(self) -> list[str]:
        if not self.numbers:
            return [self.empty or "Nothing measured in this kernel passed its checks yet: run the lesson from the top "
                    "(Run → Run All Cells) to see your own numbers here."]
        return [f"{label}: **{value}**" for label, value in self.numbers.items()]

    def _repr_markdown_(self) -> str:
        lines = ["### Your numbers", ""] + [f"- {line}" for line in self._lines()] + [""]
        return "\n".join(lines + [f"{link}  " for link in self.links()])

    def __repr__(self) -> str:  # text/plain, for viewers without Markdown
        return str(self)

    def __str__(self) -> str:
        return "\n".join(["Your numbers"] + [f"  • {line.replace('**', '')}" for line in self._lines()]
                         + self.links())


def lookup(values: dict, key: str):
    """values[key], where a dotted key reaches into dicts and lists (`profile.bandwidth_gb_s`, `ms.-1`);
    None when it was not recorded (never measured, or kept out by a physics gate)."""
    value = values
    for part in key.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return value


def next_lesson(lesson: str, lessons_dir: Path = LESSONS) -> tuple[str, str] | None:
    """The next lesson on the main path whose notebook exists: (file name, title)."""
    ids = [c[0] for c in COURSE]
    if lesson not in ids:
        raise ValueError(f"unknown lesson {lesson!r}; expected one of {ids}")
    for lid, title, _ in COURSE[ids.index(lesson) + 1:]:
        if lid not in OPTIONAL and (lessons_dir / f"{lid}.ipynb").exists():
            return f"{lid}.ipynb", title
    return None


def recap(lesson: str, numbers=(), values: dict | None = None, lessons_dir: Path = LESSONS, empty: str = "") -> Recap:
    """The end of a lesson: the numbers this kernel measured that passed their checks, and the links onward.

    The takeaways are the lesson's own hand-written Markdown; this shows the evidence beside them.
    `numbers`: (label, key into the recorded values, format) rows, e.g. ("decode, eager", "decode_ms",
    "{:.0f} ms/token"). A key that was not recorded (not measured, or flagged unreliable) is left out."""
    if lesson not in {c[0] for c in COURSE}:
        raise ValueError(f"unknown lesson {lesson!r}; expected one of {[c[0] for c in COURSE]}")
    v = recorded() if values is None else values
    shown, keys = {}, []
    for label, key, fmt in numbers:
        value = lookup(v, key)
        if value is not None and key.split(".")[0] not in v.get("unreliable", []):
            shown[label] = fmt.format(value)
            keys.append(key)
    exercises = [f"../exercises/{p}" for lid, _, ps in COURSE if lid == lesson for p in ps
                 if (lessons_dir.parent / "exercises" / p).exists()]
    r = Recap(lesson, shown, next_lesson(lesson, lessons_dir), exercises, review=(lessons_dir / REVIEW).exists(),
              empty=empty, keys=keys)
    record("recap", r.values())
    return r
