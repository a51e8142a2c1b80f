"""Kept for notebooks written against the flat package: the real module is `course.measure.costs`.

This name and `course.measure.costs` are the same module object (monkeypatching either patches both).
"""
import sys

from course.measure import costs as _module

sys.modules[__name__] = _module
