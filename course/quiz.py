"""Checkpoint quizzes (placeholder until the quiz module lands: prints nothing but a heading)."""


def checkpoint(lesson_id: str) -> None:
    print(f"Checkpoint quiz for {lesson_id}")


def self_assessment(lesson_id: str) -> None:
    print(f"Self-assessment for {lesson_id}")
