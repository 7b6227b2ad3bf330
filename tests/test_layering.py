"""The package's import graph: layers depend downward only, and no module imports itself in a circle.

The graph is read from the source with :mod:`ast` (nothing is imported): every ``import`` and
``from ... import`` at module level, inside functions and classes, and under ``if TYPE_CHECKING``,
with relative imports resolved (``from . import x`` names the module ``x`` when it is one). The
oracle is the declared order of :data:`LAYERS` below, written from what each package is for, not
from the graph.

How to read a failure: ``a -> b (line n, module level)`` is the arrow to remove. An upward arrow is
fixed by moving the shared piece down (into the lower module, or a new module below both) or by
passing a callable in; a circle the same way. A new package must be given a layer here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_gc"

#: Lowest first. A module belongs to the layer of its longest matching prefix. Imports inside one
#: layer are free (the circle check still applies); imports to a lower layer are the normal case.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # leaf helpers: validation messages, name suggestions, finiteness checks, the summary's text
    ("helpers", ("lightning_gc._validation", "lightning_gc._names", "lightning_gc._finite", "lightning_gc.summary")),
    # pure tensor transforms (no torch.distributed): the codecs, their configs and their timing
    ("compressors", ("lightning_gc.compressors",)),
    # transport: collectives, P2P ring/tree, the direct exchange, cost model, probe, ordered worker,
    # and the Exchange base class (a compressor's payload on a collective)
    ("comm", ("lightning_gc.comm",)),
    # the concrete compressed exchanges and the registry of collective= names
    ("exchanges", ("lightning_gc.exchanges",)),
    ("plans", ("lightning_gc.plans",)),
    ("engine", ("lightning_gc.engine",)),
    # what runs around the engine: synchronisation models, the ratio controller, compressor="auto"
    ("features", ("lightning_gc.sync", "lightning_gc.adaptive", "lightning_gc.auto")),
    ("callbacks", ("lightning_gc.callbacks",)),
    # the typed config tree gathers every feature's config
    ("config", ("lightning_gc.config",)),
    # the one assembly of engine, participants and session from a GCConfig, used by both front doors
    ("assembly", ("lightning_gc.assembly",)),
    ("front doors", ("lightning_gc.strategy", "lightning_gc.fabric", "lightning_gc.model_parallel")),
    ("package", ("lightning_gc",)),  # lightning_gc/__init__.py: the public names
    # demo models and data the bench and recipes train (they import only Lightning)
    ("examples", ("lightning_gc.examples",)),
    # the benchmark and `lightning-gc advise`: never imported by the runtime
    ("bench", ("lightning_gc.bench",)),
    ("cli", ("lightning_gc.cli",)),
]

#: Upward arrows allowed for now, each with the reason it is still there: (importer, imported).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Arrow:
    src: str
    dst: str
    line: int
    where: str  # "module level", "in a function", "under TYPE_CHECKING"

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} (line {self.line}, {self.where})"


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _resolve(module: str | None, level: int, current: str, is_pkg: bool) -> str:
    if level == 0:
        return module or ""
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _owner(name: str, modules: dict) -> str | None:
    """The module of ours that ``name`` denotes (a module, or a package for a name inside it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, current: str, is_pkg: bool, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(node.module, node.level, current, is_pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return [t for t in (_owner(n, modules) for n in names if n.split(".")[0] == PACKAGE) if t]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, where: str, name: str, is_pkg: bool, modules: dict, out: list[Arrow]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.extend(Arrow(name, t, child.lineno, where)
                       for t in _targets(child, name, is_pkg, modules) if t != name)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            _walk(child, "in a function", name, is_pkg, modules, out)
        elif _is_type_checking(child):
            _walk(child, "under TYPE_CHECKING", name, is_pkg, modules, out)
        else:
            _walk(child, where, name, is_pkg, modules, out)


def import_arrows(root: Path = ROOT) -> list[Arrow]:
    """Every import of one of our modules by another, with where it sits."""
    modules = _modules(root)
    arrows: list[Arrow] = []
    for name, (path, is_pkg) in modules.items():
        _walk(ast.parse(path.read_text(), str(path)), "module level", name, is_pkg, modules, arrows)
    return sorted(set(arrows), key=lambda a: (a.src, a.line, a.dst))


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module.startswith(p + ".") and p != PACKAGE  # the root names only its __init__
            if (module == p or inside) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"{module} has no layer: add its package to LAYERS in tests/test_layering.py")
    return best


def upward_arrows(arrows: list[Arrow]) -> list[Arrow]:
    return [a for a in arrows if layer_of(a.dst) > layer_of(a.src) and (a.src, a.dst) not in ALLOWED_UPWARD]


def circles(arrows: list[Arrow]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    graph: dict[str, set[str]] = {}
    for a in arrows:
        graph.setdefault(a.src, set()).add(a.dst)
        graph.setdefault(a.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle_arrows(comp: list[str], arrows: list[Arrow]) -> list[str]:
    members = set(comp)
    return sorted({str(a) for a in arrows if a.src in members and a.dst in members})


# ---------------------------------------------------------------------------------------------
# the checks on this tree


ARROWS = import_arrows()


def test_every_module_has_a_layer():
    for name in _modules(ROOT):
        layer_of(name)


def test_no_upward_import():
    bad = upward_arrows(ARROWS)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {a}  [{LAYERS[layer_of(a.src)][0]} -> {LAYERS[layer_of(a.dst)][0]}]" for a in bad)


def test_no_import_circle():
    found = circles(ARROWS)
    assert not found, "import circles:\n" + "\n".join(
        "  " + " <-> ".join(c) + "\n    " + "\n    ".join(_circle_arrows(c, ARROWS)) for c in found)


def test_runtime_never_imports_bench():
    """At any depth (a function-level import counts: the chooser calling into the bench is the case)."""
    bad = [a for a in ARROWS if a.dst.startswith("lightning_gc.bench")
           and not (a.src.startswith("lightning_gc.bench") or a.src == "lightning_gc.cli")]
    assert not bad, "runtime modules importing the bench:\n" + "\n".join(f"  {a}" for a in bad)


def test_allowed_upward_arrows_still_exist():
    """An exception that no longer matches an arrow is stale: remove it."""
    present = {(a.src, a.dst) for a in ARROWS}
    stale = [k for k in ALLOWED_UPWARD if k not in present]
    assert not stale, f"remove these entries from ALLOWED_UPWARD, their imports are gone: {stale}"


# ---------------------------------------------------------------------------------------------
# the checker itself, on small synthetic trees (the oracle: arrows written by hand)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_checker_resolves_every_import_form(tmp_path):
    root = _tree(tmp_path, {
        "lightning_gc/__init__.py": "",
        "lightning_gc/comm/__init__.py": "from . import direct\n",
        "lightning_gc/comm/direct.py": "def f():\n    from .collectives import x\n",
        "lightning_gc/comm/collectives.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from ..engine.hook import E\n",
        "lightning_gc/engine/__init__.py": "",
        "lightning_gc/engine/hook.py": "import lightning_gc.comm.direct\nfrom lightning_gc import comm\n"
                                       "from ..compressors import thing\n",
        "lightning_gc/compressors/__init__.py": "thing = 1\n",
    })
    got = {(a.src, a.dst, a.where) for a in import_arrows(root)}
    assert got == {
        ("lightning_gc.comm", "lightning_gc.comm.direct", "module level"),
        ("lightning_gc.comm.direct", "lightning_gc.comm.collectives", "in a function"),
        ("lightning_gc.comm.collectives", "lightning_gc.engine.hook", "under TYPE_CHECKING"),
        ("lightning_gc.engine.hook", "lightning_gc.comm.direct", "module level"),
        ("lightning_gc.engine.hook", "lightning_gc.comm", "module level"),
        ("lightning_gc.engine.hook", "lightning_gc.compressors", "module level"),
    }


def test_checker_finds_an_upward_arrow_and_a_circle(tmp_path):
    root = _tree(tmp_path, {
        "lightning_gc/__init__.py": "",
        "lightning_gc/comm/__init__.py": "",
        "lightning_gc/comm/a.py": "from ..engine import b\n",  # comm -> engine: upward
        "lightning_gc/engine/__init__.py": "",
        "lightning_gc/engine/b.py": "def f():\n    from . import c\n",
        "lightning_gc/engine/c.py": "from . import b\n",  # b <-> c through a function-level import
    })
    arrows = import_arrows(root)
    assert [str(a) for a in upward_arrows(arrows)] == ["lightning_gc.comm.a -> lightning_gc.engine.b (line 1, module level)"]
    assert circles(arrows) == [["lightning_gc.engine.b", "lightning_gc.engine.c"]]


def test_checker_refuses_a_module_without_a_layer():
    with pytest.raises(AssertionError, match="lightning_gc.nowhere has no layer"):
        layer_of("lightning_gc.nowhere")
