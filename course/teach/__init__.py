"""Teaching state: the question bank (`questions`), the learner's progress store, quiz and flip-card widgets.

May import: `course.engine`, `course.measure`, `course.lessons`, `course.widgets`.
"""
