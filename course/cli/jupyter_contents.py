"""The file manager `kvcourse lab` gives Jupyter: the learner's view of the course.

* Only the learner's folders are shown and served: lessons/, exercises/ and the README. The instructor's
  material (solutions/, autograde/ with the quiz's answer key, the package's source) stays out of the file
  browser; a path outside the learner's folders is "not found". This is a view, not a lock: the learner's
  own files are theirs, and grading never trusts what a learner could read (autograde/THREAT_MODEL.md).
* A saved widget says how to bring it back. A widget lives in its kernel; reopened after a restart, its saved
  output would show "Error displaying widget: model not found". On save, each widget output is stored as one
  line saying to run its cell again (the open notebook keeps its live widget).
* Notebooks open unmodified. JupyterLab marks a notebook modified as soon as its kernel starts if the kernel's
  description differs from the notebook's metadata (display name, `language_info`). The course's notebooks
  are committed with a neutral header, so this manager fills those two fields in, as this environment's kernel
  will report them, when a notebook is read.
"""
from __future__ import annotations

from functools import lru_cache

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
from tornado import web

LEARNER_TOP = {"lessons", "exercises", "README.md"}  # what the learner's file browser shows at the top
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = "This widget lives only while its kernel runs: run this cell again to bring it back."


@lru_cache(maxsize=8)
def _kernel_header(name: str) -> tuple[dict, dict] | None:
    """(kernelspec, language_info) that JupyterLab will write for kernel `name`; None for a kernel we do not know."""
    import sys

    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return None
    argv0 = spec.argv[0] if spec.argv else ""
    # jupyter_client runs a kernel whose argv starts with plain "python" with this very interpreter
    if spec.language != "python" or argv0 not in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                                                   sys.executable):
        return None
    from ipykernel.ipkernel import IPythonKernel

    kernelspec = {"name": name, "display_name": spec.display_name, "language": spec.language}
    return kernelspec, dict(IPythonKernel.language_info)


def with_kernel_header(nb) -> None:
    """Fill in `nb.metadata` (a notebook node) the way the kernel it names would."""
    name = (nb.get("metadata", {}).get("kernelspec") or {}).get("name")
    header = _kernel_header(name) if name else None
    if header is not None:
        nb["metadata"]["kernelspec"], nb["metadata"]["language_info"] = header[0], dict(header[1])


def widgets_as_notes(nb: dict) -> int:
    """Replace every widget output of a notebook (JSON dict) by a one-line note; returns how many."""
    count = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data")
            if isinstance(data, dict) and WIDGET_MIME in data:
                out["data"] = {"text/plain": WIDGET_NOTE, "text/html": f"<p><i>{WIDGET_NOTE}</i></p>"}
                count += 1
    return count


def in_learner_view(path: str) -> bool:
    top = path.strip("/").split("/", 1)[0]
    return top == "" or top in LEARNER_TOP


class CourseContentsManager(AsyncLargeFileManager):
    async def get(self, path, content=True, type=None, format=None, **kwargs):
        if content and not in_learner_view(path):  # (a folder's listing asks for each entry without content)
            raise web.HTTPError(404, f"{path} is not part of the course's learner view (lessons/, exercises/)")
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and path.strip("/") == "" and model.get("type") == "directory":
            model["content"] = [m for m in model["content"] if m["name"] in LEARNER_TOP]
        if content and model.get("type") == "notebook" and model.get("content") is not None:
            with_kernel_header(model["content"])
        return model

    async def save(self, model, path=""):
        if not in_learner_view(path):
            raise web.HTTPError(404, f"{path} is not part of the course's learner view (lessons/, exercises/)")
        if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
            widgets_as_notes(model["content"])
        return await super().save(model, path)
