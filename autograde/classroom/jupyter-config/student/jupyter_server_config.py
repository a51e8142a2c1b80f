"""Jupyter server settings for the course's users on JupyterHub (on JUPYTER_CONFIG_PATH via the hub).

Terminals start an interactive bash that is not a login shell: a login shell reads /etc/profile, which on
Debian and Ubuntu resets PATH, and the course's environment (kvcourse, nbgrader, jupyter), which the hub
puts first on PATH, would be lost.
"""
c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
c.ServerApp.terminado_settings = {"shell_command": ["bash", "-i"]}
