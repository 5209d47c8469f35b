"""Imports run one way (docs/design/brief.md "Layout"): kernels <- tandem core <- services <- tools.

Each layer is a top-level folder, so the tree shows the layers: no module's layer depends on
anything but the folder it sits in.

A module may import its own layer and any lower one, except that the three services never
import each other. Every import counts: top level, inside functions, under `if TYPE_CHECKING:`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

KERNELS, CORE, SERVICE, TOOLS = 1, 2, 3, 4
LAYER_NAMES = {KERNELS: "kernels", CORE: "core", SERVICE: "service", TOOLS: "tools"}

# Top-level package -> layer, lowest first.
LAYERS = {
    "kernels": KERNELS,          # torch numerics: imports no project package
    "tandem": CORE,              # what more than one service needs
    "verify_service": SERVICE,   # the services: kernels and core only, never each other
    "draft_service": SERVICE,
    "gateway": SERVICE,
    "tools": TOOLS,              # the tools on top (CLI, launcher, bench, distill): anything
    "benchmarks": TOOLS,
}
NOT_LAYERED = {"tests"}  # top-level directories that hold Python but sit outside the rule
GENERATED = "tandem/v1/*_pb2*.py"


def owner(module: str) -> str | None:
    """The LAYERS key a dotted module name falls under, or None for a third-party module."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, rel: Path):
    """(line, dotted name) for every import in the tree, relative ones resolved."""
    package = module_name(rel).split(".")
    if rel.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from tools import bench` imports tools.bench
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"


def check_source(source: str, rel: Path | str) -> list[str]:
    """One line per import in `source` (a file at `rel`, relative to the repo) that breaks
    the layering."""
    rel = Path(rel)
    here = owner(module_name(rel))
    assert here is not None, f"{rel} is in no layer: add it to LAYERS"
    problems = []
    for line, name in imported_names(ast.parse(source, str(rel)), rel):
        there = owner(name)
        if there is None:
            continue
        a, b = LAYERS[here], LAYERS[there]
        if b > a or (a == b == SERVICE and here != there):
            problems.append(f"{rel}:{line} imports {name} (layer {LAYER_NAMES[a]} {here} "
                            f"may not import layer {LAYER_NAMES[b]} {there})")
    return problems


def project_files() -> list[Path]:
    tops = {key.split(".")[0] for key in LAYERS}
    return sorted(p.relative_to(ROOT) for top in tops for p in (ROOT / top).rglob("*.py")
                  if not p.relative_to(ROOT).match(GENERATED))


def test_imports_run_one_way():
    problems = [msg for rel in project_files()
                for msg in check_source((ROOT / rel).read_text(encoding="utf-8"), rel)]
    assert not problems, "layering violations:\n" + "\n".join(problems)


@pytest.mark.parametrize("path,source,expected", [
    ("draft_service/fake.py", "from verify_service.engine import X",
     "imports verify_service.engine.X (layer service draft_service may not import layer "
     "service verify_service)"),
    ("tandem/spec/fake.py", "import gateway",
     "imports gateway (layer core tandem may not import layer service gateway)"),
    ("tandem/fake.py", "def f():\n    from tools.bench import x",
     "imports tools.bench.x (layer core tandem may not import layer tools tools)"),
    ("tandem/spec/fake.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from tools.distill import train", "imports tools.distill.train (layer core"),
    ("tandem/__init__.py", "from tools import cli", "imports tools.cli (layer core"),
    ("kernels/fake.py", "import tandem.errors", "(layer kernels kernels may not import"),
    ("gateway/fake.py", "from tools import launcher", "may not import layer tools"),
])
def test_checker_catches_a_wrong_import(path, source, expected):
    problems = check_source(source, path)
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("path,source", [
    ("benchmarks/fake.py", "import gateway.app, verify_service, tools.bench, kernels"),
    ("tools/bench/fake.py", "from ..distill import train\nfrom . import runner"),
    ("tools/cli.py", "from gateway.cli import register\nfrom draft_service import main"),
    ("verify_service/fake.py", "from tandem.spec import methods\nfrom .engine import E\n"
     "import kernels.sampling, torch"),
    ("tandem/engine/fake.py", "from ..spec.methods import Method\nfrom kernels import flash"),
    ("kernels/fake.py", "from .sampling import sample\nimport torch"),
])
def test_checker_allows_what_the_rule_allows(path, source):
    assert check_source(source, path) == []


def test_every_top_level_package_has_a_layer():
    tops = {key.split(".")[0] for key in LAYERS}
    found = {p.name.removesuffix(".py") for p in ROOT.iterdir()
             if not p.name.startswith(".") and not p.name.endswith(".egg-info")
             and (p.suffix == ".py" or (p.is_dir() and any(p.rglob("*.py"))))}
    assert found - NOT_LAYERED - tops == set(), "add these to LAYERS (or NOT_LAYERED)"
    missing = [key for key in LAYERS if not (ROOT / key.replace(".", "/")).is_dir()
               and not (ROOT / (key.replace(".", "/") + ".py")).is_file()]
    assert not missing, f"LAYERS names modules that do not exist: {missing}"
