"""Kept for notebooks written against the flat package: the real module is `course.engine.generate`.

This name and `course.engine.generate` are the same module object (monkeypatching either patches both).
"""
import sys

from course.engine import generate as _module

sys.modules[__name__] = _module
