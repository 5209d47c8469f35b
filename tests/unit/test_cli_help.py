"""`tandem --help` and every sub-command's `--help` answer without importing torch: the
parsers (and the defaults they show) come from torch-free config modules."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

# Runs in a fresh interpreter: walks every (nested) sub-command, asks each for --help and
# reports which printed a usage line and whether torch was imported along the way.
PROBE = r"""
import argparse, contextlib, io, json, sys
from tools.cli import build_parser, main

def commands(parser, prefix=()):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, prefix + (name,))

report = {}
for cmd in commands(build_parser()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*cmd, "--help"])
    report[" ".join(cmd)] = out.getvalue().startswith("usage: tandem")
report["torch imported"] = "torch" in sys.modules
print(json.dumps(report))
"""


def test_every_help_answers_without_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report.pop("torch imported") is False
    assert {"", "verifier", "draft", "gateway", "bench", "distill", "models fetch"} <= set(report)
    assert all(report.values()), [cmd for cmd, ok in report.items() if not ok]
