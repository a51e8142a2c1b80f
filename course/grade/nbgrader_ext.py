"""nbgrader plug-ins (autograde/nbgrader_config.py) that let one bad notebook never stop the others.

- GraderKernelManager: each kernel under an address-space cap, so a huge allocation is a MemoryError in the cell.
- SafeExecute: nbgrader's Execute, plus: a kernel that dies (os._exit, a crash, the OOM killer) or ignores the
  timeout's interrupt fails its cell, the cells after it are marked "not run", and the notebook is still scored.
- HideHiddenTests: feedback shows a test cell without its hidden region, its output reduced to passed/failed.
"""
from __future__ import annotations

import sys

from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from traitlets import Integer, Unicode

# Runs before the kernel: cap the address space, then exec the real kernel command (limits survive exec).
_CAP_AND_EXEC = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_AS, (n, n)); os.execvp(sys.argv[2], sys.argv[2:])"
)


class GraderKernelManager(AsyncKernelManager):
    """A kernel manager whose kernels cannot allocate more than memory_limit_mb of address space."""

    memory_limit_mb = Integer(4096, help="Address-space cap of a grading kernel, MiB (0: none; Linux)").tag(config=True)

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        if self.memory_limit_mb > 0 and sys.platform.startswith("linux"):
            cmd = [sys.executable, "-c", _CAP_AND_EXEC, str(self.memory_limit_mb * 2 ** 20), *cmd]
        return cmd


def error_output(ename: str, evalue: str):
    return new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


class SafeExecute(Execute):
    """nbgrader's Execute that survives a dead or stuck kernel and still returns every cell."""

    def __init__(self, **kw):
        kw.setdefault("kernel_manager_class", GraderKernelManager)
        super().__init__(**kw)

    def preprocess(self, nb, resources=None, km=None):
        self._kernel_dead = False
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, resources
        if self._kernel_dead:
            cell.outputs = [error_output("CellNotRun", "not run: the kernel died in an earlier cell")]
            return cell, resources
        try:
            cell, resources = super().preprocess_cell(cell, resources, index)
        except DeadKernelError as exc:
            self._give_up(cell, index, f"the kernel died while running this cell ({exc}): os._exit, a crash?")
        except CellTimeoutError:
            # nbclient interrupted the kernel at the timeout, but it never went idle: the code swallows
            # KeyboardInterrupt. Kill it; the cells after this one cannot run.
            run_sync(self.km.shutdown_kernel)(now=True)
            self._give_up(cell, index, "killed: the cell kept running after a timeout and an interrupt")
        return cell, resources

    def _give_up(self, cell, index, why: str) -> None:
        self._kernel_dead = True
        self.log.error("Cell %d: %s", index, why)
        cell.outputs = list(cell.get("outputs", [])) + [error_output("DeadKernelError", why)]


class HideHiddenTests(NbGraderPreprocessor):
    """Feedback preprocessor: remove hidden tests from source and output of every test cell."""

    begin_test_delimeter = Unicode("BEGIN HIDDEN TESTS").tag(config=True)
    end_test_delimeter = Unicode("END HIDDEN TESTS").tag(config=True)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type != "code" or self.begin_test_delimeter not in cell.source:
            return cell, resources
        kept, inside = [], False
        for line in cell.source.split("\n"):
            if self.begin_test_delimeter in line:
                inside = True
            elif self.end_test_delimeter in line:
                inside = False
            elif not inside:
                kept.append(line)
        cell.source = "\n".join(kept).rstrip() + "\n# (the hidden tests are not shown in feedback)"
        failure = next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)
        stderr = any(o.output_type == "stream" and o.name == "stderr" for o in cell.get("outputs", []))
        if failure is not None:
            hint = str(failure.get("evalue", "")).strip()
            detail = f": {hint}" if failure.ename == "AssertionError" and hint.startswith("hint:") else ""
            text = f"hidden tests failed ({failure.ename}{detail})\n"
        elif stderr:
            text = "hidden tests failed (the cell wrote to stderr)\n"
        else:
            text = "hidden tests passed\n"
        cell.outputs = [new_output("stream", name="stdout", text=text)]
        return cell, resources
