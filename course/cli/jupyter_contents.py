"""The file manager `kvcourse lab` gives Jupyter: notebooks open unmodified.

JupyterLab marks a notebook as modified as soon as its kernel starts if the kernel's description differs from the
notebook's metadata: it writes the kernel spec's display name ("Python 3 (ipykernel)") and the kernel's
`language_info` (Python version, lexer, MIME type...) into the notebook. The course's notebooks are committed with
a neutral header (no Python version in it), so every lesson showed the "unsaved changes" dot the moment it opened.
This manager fills those two fields in, exactly as this environment's kernel will report them, when a notebook is
read, so JupyterLab finds nothing to change. Files on disk are untouched until the learner saves.
"""
from __future__ import annotations

from functools import lru_cache

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager


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


class CourseContentsManager(AsyncLargeFileManager):
    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and model.get("type") == "notebook" and model.get("content") is not None:
            with_kernel_header(model["content"])
        return model
