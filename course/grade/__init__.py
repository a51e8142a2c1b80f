"""Grading: nbgrader's API, submissions, the sealed autograder, `check`, exercise generation, the classroom.

May import: every layer below (`engine`, `measure`, `lessons`, `widgets`, `teach`).
"""
