"""Interactive widgets (ipywidgets), one module each: the sampling explorer, the KV-cache calculator. Every widget
also renders a static view when executed headless, so notebooks run the same under the test suite and in JupyterLab.

May import: `course.engine`, `course.measure`. Never `course.lessons` (they are siblings).
"""
