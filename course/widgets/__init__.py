"""Interactive widgets (ipywidgets), one module each. Every widget also renders a static view when
executed headless, so notebooks run the same under the test suite and in JupyterLab."""
