"""Kept for notebooks written against the flat package: the real module is `course.engine.config`.

This name and `course.engine.config` are the same module object (monkeypatching either patches both).
"""
import sys

from course.engine import config as _module

sys.modules[__name__] = _module
