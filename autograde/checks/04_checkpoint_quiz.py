"""Checks for exercise 04 (the checkpoint quiz): each answer variable, as the learner set it.

The value must be a plain str; it is compared outside the sandbox, case and surrounding spaces ignored,
with the letter the solution notebook sets (so no answer is stored here or in the installed package).
The quiz's questions (autograde/quiz_questions.yaml, never in the package) are numbered 1-5 by
autograde/make_quiz.py: answer_N and its test cell test_N.
"""
from course.grade.verdicts import Check

QUESTIONS = [1, 2, 3, 4, 5]


def letter(got, ref) -> bool:
    return type(got) is str and type(ref) is str and got.strip().upper() == ref.strip().upper()


def answer(number):
    return lambda ns: ns[f"answer_{number}"]


CHECKS = {
    f"test_{n}": [Check(f"question {n}", answer(n), letter,
                        "hint: not the best option (or not one letter in quotes); revisit the lesson's checkpoint")]
    for n in QUESTIONS
}
