"""The package's floors, read from the code: every import (function-level ones included, those
under ``if TYPE_CHECKING:`` left out) must point down or sideways, and no imports go round in
a circle.

Floors, top to bottom (a module belongs to the floor of its longest matching prefix):

    6 cli                 argument parsing and printing
    5 batch, bench, evaluate, server, train_medusa, train_eagle   jobs built on the public API;
                          aot (the engine's steps compiled for a target it need not run on)
    4 llm                 the public API (the ``jaxinfer`` package re-exports it)
    3 engine
    2.5 loaders, lora     (not at the bottom: they read each family's ModelFamily (checkpoint
                          names, config parsing, weight_specs), so they sit on the models;
                          ``loaders.gguf``, the GGUF container, needs nothing and stays below;
                          lora reads adapters as the loaders read weights, into dispatch's
                          LoRAWeight)
    2 models
    1 kernels, dispatch, cache   (dispatch: the one kernel choice and the ops that follow it)
    0 the rest: pallas_kernels, gguf parsing, tokenizer, sampling, registry, sharding, quant,
      metrics, specs, config, errors, outputs, openai_format

No edge runs up, and none goes round in a circle.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxinfer", "pallas_kernels")

FLOORS = {
    "jaxinfer.cli": 6, "jaxinfer.__main__": 6,
    "jaxinfer.batch": 5, "jaxinfer.bench": 5, "jaxinfer.evaluate": 5, "jaxinfer.server": 5,
    "jaxinfer.train_medusa": 5,
    "jaxinfer.train_eagle": 5, "jaxinfer.aot": 5,
    "jaxinfer.llm": 4, "jaxinfer": 4,
    "jaxinfer.engine": 3,
    "jaxinfer.loaders": 2.5, "jaxinfer.loaders.gguf": 0, "jaxinfer.lora": 2.5,
    "jaxinfer.models": 2,
    "jaxinfer.kernels": 1, "jaxinfer.dispatch": 1, "jaxinfer.cache": 1,
}
BOTTOM = 0

def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports(ast.Module(body=[child], type_ignores=[])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _targets(module: str, node) -> set[str]:
    """The modules of ours an import statement loads (``from pkg import sub`` counts sub)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = set()
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module:
            out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    return {m: set().union(*(_targets(m, n) for n in _imports(ast.parse(p.read_text()))), set())
            for m, p in MODULES.items()}


def floor(module: str) -> float:
    if module in ("jaxinfer", "pallas_kernels"):  # the packages themselves, not as prefixes
        return FLOORS.get(module, BOTTOM)
    parts = module.split(".")
    for k in range(len(parts), 1, -1):
        if ".".join(parts[:k]) in FLOORS:
            return FLOORS[".".join(parts[:k])]
    return BOTTOM


GRAPH = _graph()


def test_the_reader_sees_function_level_and_skips_type_checking_imports():
    assert "jaxinfer.models.registry" in GRAPH["jaxinfer.loaders.hf"]  # imported inside family_for
    assert "jaxinfer.config" not in GRAPH["jaxinfer.specs"]  # only under TYPE_CHECKING
    assert "jaxinfer.loaders.convert" in GRAPH["jaxinfer.cli"]  # imported inside cmd_convert
    assert len(MODULES) > 40


def test_pallas_kernels_import_nothing_from_jaxinfer():
    bad = {(m, d) for m, deps in GRAPH.items() if m.startswith("pallas_kernels") for d in deps
           if d.startswith("jaxinfer")}
    assert not bad, bad


def test_no_import_runs_up_a_floor():
    up = sorted((m, d) for m, deps in GRAPH.items() for d in deps if floor(d) > floor(m))
    assert not up, "imports up the layering: " + ", ".join(f"{m} -> {d} ({floor(m)} -> {floor(d)})" for m, d in up)


def test_no_import_cycles():
    graph = GRAPH
    # a package's __init__ re-exporting its own modules is not a cycle with them
    graph = {m: {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")}
             for m, deps in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)



def _upward(module: str, source: str) -> set[str]:
    """The edges up a floor that ``module`` would have if its source were ``source``."""
    deps = set().union(*(_targets(module, n) for n in _imports(ast.parse(source))), set())
    return {d for d in deps if floor(d) > floor(module)}


def test_a_planted_upward_import_is_caught():
    # absolute, relative, function-level and package forms are all read; TYPE_CHECKING is not
    assert _upward("jaxinfer.models.llama", "from jaxinfer.engine import engine") == {"jaxinfer.engine.engine"}
    assert _upward("jaxinfer.models.llama", "def f():\n    from ..engine.engine import x") == {"jaxinfer.engine.engine"}
    assert _upward("jaxinfer.engine.engine", "import jaxinfer.server.app as a") == {"jaxinfer.server.app"}
    assert _upward("jaxinfer.kernels", "from jaxinfer import LLM") == {"jaxinfer"}
    assert _upward("jaxinfer.kernels", "from . import llm") == {"jaxinfer.llm"}
    assert not _upward("jaxinfer.models.llama", "import typing\nif typing.TYPE_CHECKING:\n    import jaxinfer.llm")
    assert not _upward("jaxinfer.engine.engine", "from jaxinfer.models import llama\nfrom jaxinfer import errors")


# Said outright, whatever FLOORS says: what the lower floors must never import.
NEVER = [
    (("pallas_kernels", "jaxinfer.kernels", "jaxinfer.cpu_kernels", "jaxinfer.dispatch", "jaxinfer.cache",
      "jaxinfer.quant", "jaxinfer.models"),
     ("jaxinfer.engine", "jaxinfer.server", "jaxinfer.llm", "jaxinfer.batch", "jaxinfer.cli")),
    (("jaxinfer.engine",), ("jaxinfer.server", "jaxinfer.llm", "jaxinfer.batch", "jaxinfer.cli")),
]


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("importers,imported", NEVER, ids=["kernels-and-models", "engine"])
def test_kernels_and_models_never_import_the_engine_and_the_engine_never_the_server(importers, imported):
    bad = sorted((m, d) for m, deps in GRAPH.items() if _under(m, importers) for d in deps
                 if _under(d, imported) or d == "jaxinfer")  # the package root is the public API
    assert not bad, bad
    assert any(_under(m, importers) for m in GRAPH)  # the rule reads real modules
