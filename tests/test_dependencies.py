"""pyproject.toml's dependencies against the imports in the code, read with ``ast``: a plain
install imports the package (only ``jaxinfer.server`` needs the serve extra, only the training
recipes the train extra), what ``.ci/run`` installs covers every import of the package and the
tests, and every dependency the package declares is one it imports.

Distributions are resolved through the installed packages' own metadata (requirements and
their markers, recursively) and ``importlib.metadata.packages_distributions``."""

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = {"jaxinfer", "pallas_kernels", "tests", "__future__"}
# The parts of the package that need an extra, and the extra
NEEDS_EXTRA = {"jaxinfer/server/": "serve", "jaxinfer/images.py": "vision", "jaxinfer/train_medusa.py": "train", "jaxinfer/train_eagle.py": "train"}
# Declared although no module of ours imports it by name, and why
DECLARED_FOR = {"protobuf": "sentencepiece's sentencepiece_model_pb2 (jaxinfer/tokenizer.py) imports google.protobuf, "
                            "which sentencepiece does not declare"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(extras) -> set[str]:
    """Every distribution ``pip install 'jaxinfer[extras]'`` brings in (normalised names)."""
    todo = [Requirement(r) for r in PROJECT["dependencies"]]
    todo += [Requirement(r) for e in extras for r in PROJECT["optional-dependencies"][e]]
    seen = set()
    while todo:
        req = todo.pop()
        if _norm(req.name) == "jaxinfer":  # the test extra pulls in serve and train
            todo += [Requirement(r) for e in req.extras for r in PROJECT["optional-dependencies"][e]]
            continue
        key = (_norm(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for text in metadata.requires(req.name) or []:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(dep)
    return {name for name, _ in seen}


def _imports(paths) -> dict[str, set[str]]:
    """Top-level third-party module -> the files that import it (at any depth)."""
    out = {}
    for path in paths:
        # a script outside any package (jaxinfer/data, tests/golden) imports the files beside it
        siblings = set() if (path.parent / "__init__.py").exists() else {p.stem for p in path.parent.glob("*.py")}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OURS and top not in siblings:
                    out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


DISTS = {top: {_norm(d) for d in ds} for top, ds in metadata.packages_distributions().items()}
PACKAGE = _imports(sorted((ROOT / "jaxinfer").rglob("*.py")) + sorted((ROOT / "pallas_kernels").rglob("*.py")))
TESTS = _imports(sorted((ROOT / "tests").rglob("*.py")))


def _missing(imports: dict[str, set[str]], have: set[str]) -> list[str]:
    return sorted(f"{top} ({', '.join(sorted(files))})" for top, files in imports.items()
                  if not DISTS.get(top, set()) & have)


def test_a_plain_install_covers_the_package_but_its_extras():
    have_with = {extra: _closure([extra] if extra else []) for extra in {None, *NEEDS_EXTRA.values()}}
    for top, files in PACKAGE.items():
        for f in files:
            extra = next((e for prefix, e in NEEDS_EXTRA.items() if f.startswith(prefix)), None)
            have = have_with[extra]
            assert DISTS.get(top, set()) & have, f"{f} imports {top}, which {extra or 'a plain install'} lacks"
    assert {"fastapi", "optax"} <= PACKAGE.keys()  # the extras' own imports are read


def test_what_ci_installs_covers_every_import():
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", (ROOT / ".ci/run").read_text()).group(1).split(",")
    have = _closure(extras)
    assert not _missing(PACKAGE, have), _missing(PACKAGE, have)
    assert not _missing(TESTS, have), _missing(TESTS, have)
    assert {"torch", "transformers", "openai", "hypothesis"} <= TESTS.keys()


def test_every_declared_dependency_is_imported():
    imported = set().union(*(DISTS.get(top, set()) for top in PACKAGE))
    declared = {_norm(Requirement(r).name) for r in PROJECT["dependencies"]}
    unused = sorted(declared - imported - set(DECLARED_FOR))
    assert not unused, f"declared in pyproject.toml but imported nowhere in the package: {unused}"
    assert set(DECLARED_FOR) <= declared
