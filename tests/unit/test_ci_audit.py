""".ci/audit.py (`make audit`): fails on real findings only, never on an unreachable service.

The reports are pip-audit's JSON shape, written by hand: no network here.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parents[2] / ".ci" / "audit.py"


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("ci_audit", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vuln(id_: str, *aliases: str, fixes=()) -> dict:
    return {"id": id_, "aliases": list(aliases), "fix_versions": list(fixes)}


def test_a_finding_fails_and_an_ignored_one_does_not(audit):
    deps = [{"name": "requests", "version": "2.0", "vulns": [vuln("PYSEC-1", fixes=["2.1"])]},
            {"name": "torch", "version": "2.13.0", "vulns": [vuln("GHSA-t", "CVE-9")]},
            {"name": "numpy", "version": "2.0", "vulns": []},
            {"name": "odd", "skip_reason": "Dependency not found on PyPI"}]
    status, lines = audit.summarize(deps, {"CVE-9": "no fix for torch 2.13.0 CPU yet"})
    text = "\n".join(lines)
    assert status == 1 and "VULNERABLE: requests 2.0: PYSEC-1 (fixed in: 2.1)" in text
    assert "ignored: torch 2.13.0: GHSA-t" in text and "not audited): odd" in text
    status, lines = audit.summarize(deps[1:], {"CVE-9": "no fix yet"})
    assert status == 0 and lines[-1] == "pip-audit: no known vulnerabilities"


def test_an_unreachable_service_is_reported_not_failed(audit):
    deps = [{"name": n, "skip_reason": f"Dependency not found on PyPI: {n}"} for n in "ab"]
    status, lines = audit.summarize(deps, {})
    assert status == 0 and "AUDIT NOT RUN" in lines[0]
