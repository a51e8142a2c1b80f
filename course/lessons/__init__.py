"""Helpers behind the teaching notebooks in `lessons/`, one module per topic, so notebook cells stay short.

May import: `course.engine`, `course.measure`. Never `course.widgets` (they are siblings).
"""
