"""A verifier session's state has owners (verify_service/session/sequence.py): each record is
written by one module, and the Sequence's own fields only by its methods. Read off the code's syntax
tree, so a new write from the wrong module fails here before it confuses a reader."""
import ast
from pathlib import Path

import pytest

from verify_service.session.sequence import (
    DraftLinkState,
    Estimates,
    LocalProposals,
    Scheduling,
    Sequence,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "verify_service"
OWNERS = {"sched": "policy/scheduler.py", "link": "drafts/side.py", "est": "policy/feedback.py",
          "local": "policy/auto.py", "stats": "sessions.py"}
SEQUENCE = "session/sequence.py"
RECORDS = {"sched": Scheduling, "link": DraftLinkState, "est": Estimates,
           "local": LocalProposals}
MUTATORS = {"append", "clear", "extend", "add", "update", "pop", "remove", "insert",
            "setdefault", "discard"}
OWN_FIELDS = set(Sequence.__dataclass_fields__) - set(OWNERS) - {"params"}


def _written(tree: ast.AST):
    """(attribute node, line) for every attribute assigned, augmented or mutated in place."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = list(node.targets if isinstance(node, ast.Assign) else [node.target])
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                    continue
                while isinstance(target, (ast.Subscript, ast.Starred)):
                    target = target.value
                if isinstance(target, ast.Attribute):
                    yield target, node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute):
            yield node.func.value, node.lineno


def violations(path: Path, source: str) -> list[str]:
    found = []
    for attr, line in _written(ast.parse(source)):
        base = attr.value
        rel = path.relative_to(ROOT).as_posix()
        if isinstance(base, ast.Attribute) and base.attr in OWNERS \
                and rel not in (OWNERS[base.attr], SEQUENCE):
            found.append(f"{rel}:{line} writes .{base.attr}.{attr.attr} "
                         f"(owned by {OWNERS[base.attr]})")
        elif attr.attr in OWN_FIELDS and rel != SEQUENCE \
                and not (isinstance(base, ast.Name) and base.id == "self"):
            found.append(f"{rel}:{line} writes Sequence.{attr.attr} "
                         "(only Sequence's methods do)")
    return found


def test_each_record_is_written_by_its_owner_alone():
    found = [v for p in sorted(ROOT.rglob("*.py")) for v in violations(p, p.read_text())]
    assert found == []


def test_the_check_catches_a_write_from_the_wrong_module():
    bad = "def f(seq):\n    seq.est.late_rounds = 0\n    seq.epoch += 1\n" \
          "    seq.local.proposals[1] = 2\n    seq.sched.carried = True\n"
    assert len(violations(ROOT / "drafts/side.py", bad)) == 4
    assert len(violations(ROOT / "policy/feedback.py", bad)) == 3  # its own record is fine


def test_every_record_field_has_one_home():
    """No field name on two records (or on the Sequence and a record): one name, one place."""
    names = [f for rec in RECORDS.values() for f in rec.__dataclass_fields__]
    names += list(OWN_FIELDS)
    assert len(names) == len(set(names))
