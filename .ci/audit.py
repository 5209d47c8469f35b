"""`make audit`: pip-audit over the installed dependencies; fails only on real findings.

pip-audit asks PyPI's JSON API (`--vulnerability-service pypi`) about every installed
distribution. Where that service cannot be reached (an offline runner, a mirror without the
per-version JSON API), nothing gets audited: this script then says so loudly and exits 0, so
CI fails on known vulnerabilities only, never on the network. Local builds such as the
torch +cpu wheel are unknown to PyPI, so they are audited a second time as their public
release (torch==2.13.0), whose advisories apply to them too. The editable project is skipped.
"""
from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata, util

# Advisories accepted on purpose: id (or alias: CVE-..., GHSA-...) -> why. Only for one with no
# fixed release we can take, e.g. a torch advisory fixed only after the pinned torch==2.13.0
# CPU wheel. Each entry names the advisory, why it does not apply or cannot be fixed yet, and
# when to look again. Empty: nothing is ignored.
IGNORED: dict[str, str] = {}

TIMEOUT_S = 50  # per pip-audit run: the audit must not add more than about a minute to CI
BASE = [sys.executable, "-m", "pip_audit", "--format", "json", "--progress-spinner", "off",
        "--vulnerability-service", "pypi", "--timeout", "10"]


def run_pip_audit(args: list[str]) -> tuple[dict | None, str]:
    """pip-audit's JSON report, or None and why it could not run."""
    try:
        proc = subprocess.run(BASE + args, capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"pip-audit took longer than {TIMEOUT_S} s"
    try:
        return json.loads(proc.stdout), ""
    except json.JSONDecodeError:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"pip-audit exited with {proc.returncode}"


def local_builds(report: dict) -> list[str]:
    """`name==public version` for skipped distributions with a local version (2.13.0+cpu)."""
    pins = []
    for dep in report.get("dependencies", []):
        if "skip_reason" not in dep:
            continue
        try:
            version = metadata.version(dep["name"])
        except metadata.PackageNotFoundError:
            continue
        if "+" in version:
            pins.append(f"{dep['name']}=={version.split('+', 1)[0]}")
    return pins


def audit_local_builds(pins: list[str], tmp_dir: str) -> tuple[dict | None, str]:
    path = f"{tmp_dir}/local-builds.txt"
    with open(path, "w") as f:
        f.write("\n".join(pins) + "\n")
    return run_pip_audit(["--no-deps", "--disable-pip", "-r", path])


def findings(deps: list[dict], ignored: dict[str, str]) -> tuple[list[str], list[str]]:
    """(real findings, ignored ones) as printable lines."""
    found, skipped = [], []
    for dep in deps:
        for vuln in dep.get("vulns", []):
            ids = {vuln["id"], *vuln.get("aliases", [])}
            fixes = ", ".join(vuln.get("fix_versions", [])) or "no fixed release"
            line = f"{dep['name']} {dep['version']}: {vuln['id']} (fixed in: {fixes})"
            why = next((ignored[i] for i in sorted(ids) if i in ignored), None)
            if why is None:
                found.append(line)
            else:
                skipped.append(f"{line}; ignored: {why}")
    return found, skipped


def summarize(deps: list[dict], ignored: dict[str, str]) -> tuple[int, list[str]]:
    """Exit status and report for the merged dependency list of pip-audit's reports."""
    audited = [d for d in deps if "skip_reason" not in d]
    unknown = [d for d in deps if "skip_reason" in d]
    if not audited:
        first = unknown[0]["skip_reason"] if unknown else "no dependencies listed"
        return 0, [f"pip-audit: AUDIT NOT RUN: the vulnerability service answered for none of "
                   f"{len(deps)} packages (e.g. {first}). Not a failure: the service is "
                   "unreachable from here; run `make audit` where pypi.org's JSON API is."]
    found, skipped = findings(audited, ignored)
    lines = [f"pip-audit: {len(audited)} packages audited, {len(unknown)} not known to the "
             "service (not audited): " + ", ".join(sorted(d["name"] for d in unknown))]
    lines += [f"  ignored: {s}" for s in skipped]
    if found:
        lines += [f"  VULNERABLE: {f}" for f in found]
        lines.append(f"pip-audit: {len(found)} known vulnerabilities: upgrade, or add a "
                     "commented entry to IGNORED in .ci/audit.py")
        return 1, lines
    lines.append("pip-audit: no known vulnerabilities")
    return 0, lines


def main() -> int:
    import tempfile

    if util.find_spec("pip_audit") is None:
        print("pip-audit is not installed: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    report, why = run_pip_audit(["--skip-editable"])
    if report is None:
        print(f"pip-audit: AUDIT NOT RUN ({why}). Not a failure: the vulnerability service "
              "could not be used from here.")
        return 0
    deps = [d for d in report.get("dependencies", [])
            if "editable" not in d.get("skip_reason", "")]
    pins = local_builds(report)
    if pins:
        with tempfile.TemporaryDirectory() as tmp:
            extra, _ = audit_local_builds(pins, tmp)
        audited_again = {d["name"] for d in (extra or {}).get("dependencies", [])
                         if "skip_reason" not in d}
        deps = [d for d in deps if d["name"] not in audited_again]
        deps += [d for d in (extra or {}).get("dependencies", []) if "skip_reason" not in d]
    status, lines = summarize(deps, IGNORED)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
