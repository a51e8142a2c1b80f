"""Kept for notebooks written against the flat package: the real module is `course.engine.model`.

This name and `course.engine.model` are the same module object (monkeypatching either patches both).
"""
import sys

from course.engine import model as _module

sys.modules[__name__] = _module
