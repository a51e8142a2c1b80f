"""The package's layers import only downward, and no modules import each other in a circle.

engine ← measure ← {lessons, widgets} ← teach ← grade ← cli. `lessons` and `widgets` are siblings and never import
each other. At the root, `course/__init__.py` may use the engine and `course/paths.py` imports nothing of the course;
the five old flat names (config, memory, generate, model, exercise_tools) are gone and must not be imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "course"
LAYERS = {"engine": 0, "measure": 1, "lessons": 2, "widgets": 2, "teach": 3, "grade": 4, "cli": 5}
SIBLINGS = {frozenset({"lessons", "widgets"})}
SHIMS = {"config": "course.engine.config", "memory": "course.measure.costs", "generate": "course.engine.generate",
         "model": "course.engine.model", "exercise_tools": "course.grade.exercise_tools"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every `course...` module this file imports, relative imports resolved, at any depth (also inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "course"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "course":
                continue
            found.add(target)
            for alias in node.names:  # `from course.engine import model` imports a module
                candidate = f"{target}.{alias.name}"
                if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or \
                        (PACKAGE.parent / candidate.replace(".", "/") / "__init__.py").exists():
                    found.add(candidate)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in g.items():
        here = layer(mod)
        for t in sorted(targets):
            there = layer(t)
            if t == mod or t == "course":
                if here is not None and t == "course" and LAYERS[here] < LAYERS["grade"]:
                    bad.append(f"{mod} imports the package root `course` (import from its layer instead)")
                continue
            if here is None:  # root modules
                leaf = mod.split(".")[-1] if mod != "course" else "__init__"
                if leaf == "paths":
                    bad.append(f"course.paths must import nothing of the course, imports {t}")
                elif leaf in SHIMS and t not in (SHIMS[leaf], SHIMS[leaf].rsplit(".", 1)[0]):
                    bad.append(f"{mod} is a compatibility name for {SHIMS[leaf]} and must import only that, imports {t}")
                elif leaf == "__init__" and there not in (None, "engine"):
                    bad.append(f"course/__init__.py may use only the engine, imports {t}")
                continue
            if there is None:
                if t.split(".")[-1] in SHIMS:
                    bad.append(f"{mod} imports the compatibility name {t}: import {SHIMS[t.split('.')[-1]]}")
                continue  # course.paths is below everything
            if frozenset({here, there}) in SIBLINGS and here != there:
                bad.append(f"{mod} ({here}) imports its sibling layer {t} ({there})")
            elif LAYERS[there] > LAYERS[here]:
                bad.append(f"{mod} ({here}) imports up a layer: {t} ({there})")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_every_module_sits_in_a_layer():
    strays = [m for m in graph() if layer(m) is None and m.split(".")[-1] not in {"course", "paths", *SHIMS}]
    assert not strays, f"modules outside every layer (move them into a subpackage): {strays}"


def test_imports_point_only_down():
    bad = violations(graph())
    assert not bad, "imports that break the layer rule:\n" + "\n".join(bad)


def test_no_import_circles():
    circles = cycles(graph())
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_each_layer_says_what_it_may_import():
    for name in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"course/{name}/__init__.py must say what it may import"


def test_the_rule_catches_an_upward_import_and_a_circle():
    g = {"course.engine.a": {"course.teach.q"}, "course.teach.q": set(),
         "course.lessons.x": {"course.widgets.y"}, "course.widgets.y": set(),
         "course.measure.m": {"course.measure.n"}, "course.measure.n": {"course.measure.m"}}
    bad = violations(g)
    assert any("course.engine.a" in b and "up a layer" in b for b in bad)
    assert any("sibling" in b for b in bad)
    assert cycles(g) == [["course.measure.m", "course.measure.n"]]
