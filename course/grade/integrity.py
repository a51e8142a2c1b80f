"""Notes for the instructor on code that reaches past its own exercise: read, never judged.

The grader judges what a submission's functions return, compared outside with the solution's values. Two
things that comparison cannot see are worth a teacher's look, so report.csv names them (the score is not
changed: an import can be innocent, and a note costs the teacher one look):

* the course's own implementation handed in: an import from the `course` package that the released notebook
  does not make (`from course.engine.sampling import sample`) returns the right values without the learner
  writing them;
* code that reaches into the interpreter the checks run in (gc, ctypes, frames, inspect, threads, signals,
  raw file descriptors, sys.modules): an exercise never needs it, and it is how a submission would tamper with
  the grading (the checks run in the learner's process, as nbgrader's hidden tests do).

The scan reads the code cells' source with Python's `ast` (IPython magics and shell lines are blanked first);
a cell that does not parse is scanned as text for the same names.
"""
from __future__ import annotations

import ast
import re

REACHING_MODULES = {"gc", "ctypes", "inspect", "importlib", "_thread", "threading", "multiprocessing", "signal",
                    "atexit", "builtins", "faulthandler", "_ctypes", "cffi"}
REACHING_ATTRS = {"_getframe", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame", "gi_frame",
                  "cr_frame", "__globals__", "__code__", "__closure__", "__builtins__", "__subclasses__"}
PROCESS_ATTRS = {"settrace", "setprofile", "modules", "dup", "dup2", "fdopen", "fork", "forkpty", "kill", "killpg",
                 "_exit", "memfd_create", "set_inheritable", "pthread_kill", "write", "pipe"}  # of os, sys, signal
HARMLESS = {"course.config", "course.engine.config", "course.engine.device", "course.paths"}  # shapes, devices
REACHING_CALLS = {"__import__", "exec", "eval", "compile", "globals", "vars", "breakpoint", "get_ipython"}
REACHING_TEXT = ("/proc/", "/dev/fd")


def _is_test(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return isinstance(meta, dict) and bool(meta.get("grade")) and not meta.get("solution")


def _source(cell) -> str:
    src = cell.get("source", "")
    src = "".join(src) if isinstance(src, list) else str(src)
    # IPython's %magics and !shell lines are not Python: blank them so the rest still parses
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())


def _course_imports(tree: ast.AST) -> set[str]:
    """'module:name' for `from course.x import name`, 'module:' for `import course.x` (and aliases)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                (node.module == "course" or node.module.startswith("course.")):
            found |= {f"{node.module}:{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {f"{a.name}:" for a in node.names if a.name == "course" or a.name.startswith("course.")}
    return found


def _imported_names(tree: ast.AST) -> set[str]:
    """The names import statements bind (torch, np, F, …): assigning to their attributes patches a library."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def _reaching(tree: ast.AST, modules: set[str]) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:  # torch.allclose = …: a library patched for everyone in the process, the checks too
            while isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                t = t.value
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                used.add(f"{t.value.id}.{t.attr} = …")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in modules:
            used.add(f"{node.func.id}({node.args[0].id}, …)")
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names if a.name.split(".")[0] in REACHING_MODULES or a.name in REACHING_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in REACHING_MODULES or node.module in REACHING_MODULES:
                used.add(node.module)
            if top in ("os", "sys"):
                used |= {f"{node.module}.{a.name}" for a in node.names if a.name in REACHING_ATTRS | PROCESS_ATTRS}
        elif isinstance(node, ast.Attribute) and node.attr in REACHING_ATTRS:
            used.add(node.attr)
        elif isinstance(node, ast.Attribute) and node.attr in PROCESS_ATTRS and isinstance(node.value, ast.Name) \
                and node.value.id in ("os", "sys", "signal"):  # model.modules() is fine, sys.modules is not
            used.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REACHING_CALLS:
            used.add(f"{node.func.id}()")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                any(t in node.value for t in REACHING_TEXT):
            used.add(repr(node.value[:40]))
    return used


def _text_scan(source: str) -> set[str]:
    names = REACHING_MODULES | REACHING_ATTRS | REACHING_CALLS | {f"os.{a}" for a in PROCESS_ATTRS} | \
        {f"sys.{a}" for a in PROCESS_ATTRS}
    return {n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}\b|\.{re.escape(n)}\b", source)} | \
        {t for t in REACHING_TEXT if t in source}


def _parsed(nb) -> list[tuple[dict, str, ast.AST | None]]:
    """(cell, source, tree or None where it does not parse) for every code cell."""
    out = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            source = _source(cell)
            try:
                out.append((cell, source, ast.parse(source)))
            except SyntaxError:
                out.append((cell, source, None))
    return out


def flags(nb, release_nb) -> list[str]:
    """Notes for report.csv: course imports the release does not make, and code that reaches into the process."""
    allowed = {a for _, _, tree in _parsed(release_nb) if tree is not None for a in _course_imports(tree)}
    cells = _parsed(nb)
    modules = {n for _, _, tree in cells if tree is not None for n in _imported_names(tree)}
    extra, reaching = set(), set()
    for cell, source, tree in cells:
        if _is_test(cell):
            continue
        if tree is None:
            reaching |= _text_scan(source)
            extra |= {m for m in re.findall(r"(?:from|import)\s+(course(?:\.\w+)*)", source)} - \
                {a.split(":")[0] for a in allowed}
            continue
        extra |= {e for e in _course_imports(tree) - allowed if e.split(":")[0] not in HARMLESS}
        reaching |= _reaching(tree, modules)
    notes = []
    if extra:
        shown = sorted(f"import {e[:-1]}" if e.endswith(":") else e.replace(":", ".") for e in extra)
        notes.append("check by hand: it uses the course's own code the released notebook does not import ("
                     + ", ".join(shown[:6]) + (" …" if len(shown) > 6 else "")
                     + "): its answers may be the course's, not the student's")
    if reaching:
        shown = sorted(reaching)
        notes.append("check by hand: it reaches into the grading process (" + ", ".join(shown[:8])
                     + (" …" if len(shown) > 8 else "") + "), which no exercise needs")
    return notes
