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

from course.grade.harness import is_test_cell

REACHING_MODULES = {"ctypes", "_thread", "signal", "atexit", "builtins", "faulthandler", "_ctypes", "cffi", "pkgutil",
                    "runpy", "_imp", "dis", "pydoc", "IPython.utils.importstring", "code", "codeop"}
SAFE_USES = {"gc": {"collect", "disable", "enable", "isenabled", "get_count", "get_stats", "freeze"},
             "inspect": {"signature", "getsource", "getdoc", "isclass", "isfunction", "ismethod", "getfullargspec",
                         "cleandoc", "Parameter", "Signature"},
             "pickle": {"dump", "dumps", "HIGHEST_PROTOCOL"},
             "traceback": {"format_exc", "print_exc", "format_exception", "print_exception", "format_exception_only",
                           "TracebackException", "print_stack", "format_stack", "extract_stack", "extract_tb",
                           "format_tb", "print_tb", "format_list", "print_list", "StackSummary", "FrameSummary"}}
# anything else of these is noted (pickle.loads of a constant imports any module: the scan would not see it;
# traceback.walk_stack hands out the frame objects the checks run in, where extract_stack gives only their text)
REACHING_ATTRS = {"_getframe", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame", "gi_frame",
                  "cr_frame", "__globals__", "__code__", "__closure__", "__builtins__", "__subclasses__",
                  "__getattribute__"}  # f.__getattribute__('__clo' + 'sure__') is f.__closure__
PROCESS_ATTRS = {"settrace", "setprofile", "modules", "dup", "dup2", "fdopen", "fork", "forkpty", "kill", "killpg",
                 "_exit", "memfd_create", "set_inheritable", "pthread_kill", "write", "pipe"}  # of os, sys, signal
HARMLESS = {"course.config", "course.engine.config", "course.engine.device", "course.paths"}  # shapes, devices
HARMLESS_NAMES = {"course.memory:human_bytes", "course.memory:GiB", "course.memory:MiB",
                  "course.measure.costs:human_bytes", "course.measure.costs:GiB"}  # printing helpers
REACHING_CALLS = {"__import__", "exec", "eval", "compile", "get_ipython", "import_item"}
REACHING_ATTR_CALLS = {"import_module", "resolve_name", "run_module", "run_path", "find_spec", "exec_module", "locate",
                       "currentframe", "import_item", "__import__", "walk_stack", "walk_tb", "reload", "load_module",
                       "SourceFileLoader", "spec_from_file_location", "module_from_spec", "FunctionType", "CodeType",
                       "runsource", "runcode"}  # importlib.__import__("course." + "x"): a module named in code the
# scan cannot read; a module loaded anew from its file; a function built from a code object
GETTERS = {"attrgetter", "methodcaller"}  # operator.attrgetter("f_locals")(frame) is frame.f_locals
CODE_MAGICS = {"run", "writefile", "load", "loadpy"}  # they run or write code the scan cannot see
PROCESS_TEXT = re.compile(r"/proc/(?:self|thread-self|\d+)/|/dev/fd\b")  # not /proc/meminfo, /proc/cpuinfo
MAGICS_WITH_CODE = {"time", "timeit", "prun", "capture"}  # %time CODE runs CODE: scanned like any other line


def _source(cell) -> str:
    """The cell as the Python IPython runs: %magics and !shell lines become get_ipython() calls (a magic's code
    argument is scanned too, so `%time import gc` is not hidden)."""
    src = cell.get("source", "")
    src = "".join(src) if isinstance(src, list) else str(src)
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(src)
    except Exception:  # no IPython, or a cell it cannot read: the magic and shell lines blanked instead
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                re.fullmatch(r"course(?:\.\w+)+", node.value):  # import_module("course.engine.sampling")
            found.add(f"{node.value}:")
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


def _magic_code(node: ast.Call) -> list[str]:
    """The code a get_ipython().run_line_magic('time', CODE) / run_cell_magic('time', '', CODE) runs."""
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in ("run_line_magic", "run_cell_magic") and node.args and \
            isinstance(node.args[0], ast.Constant) and str(node.args[0].value).lstrip("%") in MAGICS_WITH_CODE:
        return [a.value for a in node.args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return []


def _is_ipython_call(node: ast.Call) -> bool:
    """get_ipython().run_line_magic / run_cell_magic / system / getoutput: what IPython makes of % and ! lines."""
    f = node.func
    return isinstance(f, ast.Attribute) and f.attr in ("run_line_magic", "run_cell_magic", "system", "getoutput") \
        and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) and f.value.func.id == "get_ipython"


def _chain(node) -> list[str]:
    """a.b.c -> ['a', 'b', 'c'] (empty when it does not start at a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _reaching(tree: ast.AST, modules: set[str]) -> set[str]:
    used = set()
    ipython_calls = {id(n.func.value) for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_ipython_call(n)}
    membership = {id(c) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                  and all(isinstance(o, (ast.In, ast.NotIn)) for o in n.ops) for c in n.comparators}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:  # torch.allclose = …: a library patched for everyone in the process, the checks too
            chain = _chain(t)
            if len(chain) >= 2 and chain[0] in modules and not {"backends", "config"} & set(chain):  # settings
                used.add(f"{'.'.join(chain)} = …")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id in modules:
                used.add(f"{f.id}({node.args[0].id}, …)")
            if isinstance(f, ast.Name) and f.id in ("getattr", "setattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value  # getattr(f, "__globals__") is f.__globals__, and is noted as such
                base = node.args[0].id if isinstance(node.args[0], ast.Name) else ""
                if name in REACHING_ATTRS:
                    used.add(name)
                elif name in REACHING_ATTR_CALLS:
                    used.add(f".{name}()")
                elif base in ("os", "sys", "signal") and name in PROCESS_ATTRS:
                    used.add(f"{base}.{name}")
                elif base in SAFE_USES and name not in SAFE_USES[base]:
                    used.add(f"{base}.{name}")
            if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2 and \
                    not isinstance(node.args[1], ast.Constant) and (
                        isinstance(node.args[1], (ast.BinOp, ast.JoinedStr, ast.Call)) or  # 'f_' + 'back'
                        isinstance(node.args[0], ast.Name) and node.args[0].id in modules | {"__builtins__"}):
                used.add("getattr(…, <a name built in code>)")
            if isinstance(f, ast.Attribute) and f.attr in ("run_line_magic", "run_cell_magic") and node.args and \
                    isinstance(node.args[0], ast.Constant) and str(node.args[0].value).lstrip("%") in CODE_MAGICS:
                used.add(f"%{str(node.args[0].value).lstrip('%')}")
            if isinstance(f, ast.Name) and f.id in REACHING_CALLS and \
                    not (f.id == "get_ipython" and id(node) in ipython_calls):
                used.add(f"{f.id}()")
            if isinstance(f, ast.Attribute) and f.attr in REACHING_ATTR_CALLS:
                used.add(f".{f.attr}()")
            getter = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if getter in GETTERS and node.args and not all(  # attrgetter("x.y") of plain names is getattr
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and not any(
                        part in REACHING_ATTRS or part.startswith("__") for part in a.value.split("."))
                    for a in node.args[:1 if getter == "methodcaller" else None]):
                used.add(f"{getter}(…)")
            if isinstance(f, ast.Name) and f.id == "open" and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).endswith(".py") and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) & set("wax")
                    for a in node.args[1:2]):
                used.add(f"writes {node.args[0].value}")  # a module of its own, imported after
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names if a.name.split(".")[0] in REACHING_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in REACHING_MODULES:
                used.add(node.module)
            if top in SAFE_USES:
                used |= {f"{top}.{a.name}" for a in node.names if a.name not in SAFE_USES[top]}
            if top in ("os", "sys"):
                used |= {f"{node.module}.{a.name}" for a in node.names if a.name in REACHING_ATTRS | PROCESS_ATTRS}
            used |= {f".{a.name}()" for a in node.names if a.name in REACHING_ATTR_CALLS}  # import_module as im
        elif isinstance(node, ast.Attribute) and node.attr in REACHING_ATTRS:
            used.add(node.attr)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = node.value.id
            if base in ("os", "sys", "signal") and node.attr in PROCESS_ATTRS and id(node) not in membership:
                used.add(f"{base}.{node.attr}")  # model.modules() is fine, and so is `"x" in sys.modules`
            elif base in SAFE_USES and node.attr not in SAFE_USES[base]:
                used.add(f"{base}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "__builtins__":
            used.add("__builtins__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PROCESS_TEXT.search(node.value):
            used.add(repr(node.value[:40]))
    return used


def _text_scan(source: str) -> set[str]:
    """For a cell that does not parse: the same names, looked for as whole words outside comments."""
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    names = REACHING_MODULES | REACHING_ATTRS | REACHING_CALLS | {f"os.{a}" for a in PROCESS_ATTRS} | \
        {f"sys.{a}" for a in PROCESS_ATTRS}
    found = {n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}\b", code)}
    return found | ({"/proc/<pid>/…"} if PROCESS_TEXT.search(code) else set())


def _parsed(nb) -> list[tuple[dict, str, ast.AST | None]]:
    """(cell, source, tree or None where it does not parse) for every code cell."""
    out = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            source = _source(cell)
            try:
                out.append((cell, source, ast.parse(source)))
            except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte; the other
                out.append((cell, source, None))  # two: nesting too deep for the parser (1 + 1 + … 10,000 times)
    return out


def _trees(tree: ast.AST, depth: int = 0):
    """The cell's tree and the trees of the code its %time/%timeit/%%time magics run."""
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and depth < 3:
            for code in _magic_code(node):
                try:
                    tree = ast.parse(code)
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    continue
                yield from _trees(tree, depth + 1)


def _course_chains(tree: ast.AST) -> set[str]:
    """What is reached through a name an `import course…` bound, or a name assigned from such a chain
    (`import course.config` binds `course`: course.memory.kv_cache_bytes gives that name; `e = course.engine`
    then e.sampling.sample gives course.engine.sampling.sample). Chains of three names and more, as written."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "course" or a.name.startswith("course."):
                    bound[a.asname or "course"] = a.name if a.asname else "course"
    for _ in range(3):  # aliases of aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                chain = _chain(node.value)
                if chain and chain[0] in bound:
                    bound[node.targets[0].id] = ".".join([bound[chain[0]], *chain[1:]])
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in bound:
                full = ".".join([bound[chain[0]], *chain[1:]]).split(".")
                if len(full) >= 3:
                    used.add(".".join(full[:4]))  # course.engine.kv_cache.LayerKVCache
    return used


def flags(nb, release_nb) -> list[str]:
    """Notes for report.csv: course imports the release does not make, and code that reaches into the process."""
    allowed = {a for _, _, tree in _parsed(release_nb) if tree is not None for t in _trees(tree)
               for a in _course_imports(t)}
    allowed_modules = ({a.split(":")[0] for a in allowed} | {a.replace(":", ".") for a in allowed} | HARMLESS) - \
        {"course"}  # the release's own `import course` does not make every course.engine.… chain its code
    # a chain may reach only what the release imports by name (`from course.memory import GiB` allows
    # course.memory.GiB, not course.memory.kv_cache_bytes), or anything of a module it imports whole
    reachable = ({a.replace(":", ".") for a in allowed if not a.endswith(":")} | {a[:-1] for a in allowed
                 if a.endswith(":")} | {n.replace(":", ".") for n in HARMLESS_NAMES} | HARMLESS) - {"course"}
    cells = _parsed(nb)
    modules = {n for _, _, tree in cells if tree is not None for t in _trees(tree) for n in _imported_names(t)}
    extra, reaching = set(), set()
    for cell, source, tree in cells:
        if is_test_cell(cell):
            continue
        if tree is None:
            reaching |= _text_scan(source)
            extra |= {m for m in re.findall(r"(?:from|import)\s+(course(?:\.\w+)*)", source)} - allowed_modules
            continue
        for t in _trees(tree):
            extra |= {e for e in _course_imports(t) - allowed - HARMLESS_NAMES if e.split(":")[0] not in HARMLESS}
            reaching |= _reaching(t, modules)  # the cell's code and what its %time magics run
            extra |= {c for c in _course_chains(t) if not any(c == m or c.startswith(m + ".") or m.startswith(c + ".")
                                                                for m in reachable)}
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
