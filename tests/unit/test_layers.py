"""Imports run one way (docs/design/homes.md): kernels <- tandem <- services <- tools <-
benchmarks, the three services never importing each other, and the verifier's own floors.

The rules are import-linter contracts in pyproject.toml ([tool.importlinter]); `lint-imports`
checks them here so that `make test` does. Every import counts: top level, inside functions,
under `if TYPE_CHECKING:`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (pyproject's floor): the same parser, as tomli
    import tomli as tomllib

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))
NOT_LAYERED = {"tests"}  # top-level directories that hold Python but sit outside the rule


def lint_imports(cwd: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([LINT_IMPORTS, str(config), "--no-cache"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_imports_run_one_way():
    out = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


# import-linter checks the packages it is given; that every top-level package is given is ours.
def test_every_top_level_package_has_a_layer():
    found = {p.name.removesuffix(".py") for p in ROOT.iterdir()
             if not p.name.startswith(".") and not p.name.endswith(".egg-info")
             and (p.suffix == ".py" or (p.is_dir() and any(p.rglob("*.py"))))}
    assert found - NOT_LAYERED - set(CONFIG["root_packages"]) == set(), \
        "add these to [tool.importlinter] root_packages and a layer"


@pytest.mark.parametrize("path,source", [
    ("draft_service/fake.py", "from verify_service import engine"),
    ("tandem/fake.py", "def f():\n    from tools import bench"),
    ("tandem/fake2.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from gateway import app"),
    ("kernels/fake.py", "import tandem.errors"),
    ("verify_service/forward/fake.py", "from verify_service import engine"),
])
def test_the_contracts_catch_a_wrong_import(tmp_path, path, source):
    """The same contracts over a tree of empty packages with one wrong import planted."""
    for top in CONFIG["root_packages"]:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    for sub in ("forward", "session", "tp", "policy", "drafts"):
        (tmp_path / "verify_service" / sub).mkdir()
        (tmp_path / "verify_service" / sub / "__init__.py").write_text("")
    for mod in ("cli", "main", "server", "assemble", "engine", "sessions", "config"):
        (tmp_path / "verify_service" / f"{mod}.py").write_text("")
    for mod in ("errors", "bench"):
        (tmp_path / ("tandem" if mod == "errors" else "tools") / f"{mod}.py").write_text("")
    (tmp_path / "gateway" / "app.py").write_text("")
    (tmp_path / "verify_service" / "policy" / "auto.py").write_text("")
    (tmp_path / "verify_service" / "drafts" / "side.py").write_text("")
    (tmp_path / "verify_service" / "forward" / "inputs.py").write_text(  # the ignored imports
        "from verify_service.policy import auto\nfrom verify_service.drafts import side\n"
        "from verify_service import sessions\n")
    (tmp_path / path).write_text(source + "\n")
    config = tmp_path / "pyproject.toml"
    config.write_text((ROOT / "pyproject.toml").read_text())
    out = lint_imports(tmp_path, config)
    assert out.returncode != 0 and "1 broken" in out.stdout, out.stdout + out.stderr
