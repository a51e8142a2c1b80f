"""nbgrader configuration for tools started at the project root: JupyterLab's Validate button (the
`kvcourse lab` server runs here), the formgrader and plain `nbgrader ...` commands.

The course's configuration lives in autograde/nbgrader_config.py (every bit of nbgrader state inside
autograde/); this file only loads it.
"""
import os

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
load_subconfig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "autograde", "nbgrader_config.py"))  # noqa: F821
