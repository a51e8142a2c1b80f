"""Checks for exercise 04 (the checkpoint quiz): each answer variable, as the learner set it.

The value must be a plain str; it is compared outside the sandbox, case and surrounding spaces ignored,
with the letter the solution notebook sets (so no answer is stored here or in the installed package).
"""
from course.grade.verdicts import Check

QUESTIONS = ["seed-1", "seed-3", "seed-2", "seed-5", "seed-4"]


def letter(got, ref) -> bool:
    return type(got) is str and type(ref) is str and got.strip().upper() == ref.strip().upper()


def answer(qid):
    return lambda ns: ns["answer_" + qid.replace("-", "_")]


CHECKS = {
    f"test_{qid}": [Check(f"question {qid}", answer(qid), letter,
                          "hint: not the best option (or not one letter in quotes); revisit the lesson's checkpoint")]
    for qid in QUESTIONS
}
