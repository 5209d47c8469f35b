"""gpu-check's phase runner: every phase in its own time box, one after the other.

A phase is a function of a PhaseContext that fills `ctx.result` (a dict, readable even while
the phase runs) and may record pass/fail checks with `ctx.check`. The runner runs it in a
daemon thread and waits at most its box: a phase still running then is reported as `timeout`
with what it had recorded so far, and the next phase starts (the overrunning thread is left
behind; a GPU figure taken while it still runs says so in the report). A phase that raises is
reported as `error` with the exception; one whose checks fail, as `failed`. Phases also read
`ctx.left()` and stop their own loops early when the box runs out (then `timeout` too).
"""
from __future__ import annotations

import copy
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

STATUSES = ("ok", "failed", "error", "timeout", "skipped")


@dataclass(frozen=True)
class Phase:
    name: str
    box_s: float  # time box on a GPU; --box-scale multiplies it
    run: Callable[[PhaseContext], None]
    about: str  # one line for --help and the report

    def __post_init__(self):
        if not self.name or self.box_s <= 0:
            raise ValueError(f"a phase needs a name and a positive box, got {self!r}")


@dataclass
class PhaseContext:
    """What a phase gets: the device and options, its deadline, a shared cache of models
    between phases, and the dict it reports into."""

    device: object  # torch.device
    tiny: bool
    deadline: float  # time.monotonic() past which the phase should stop
    cache: dict
    log: Callable[[str], None]
    result: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def out_of_time(self) -> bool:
        """True (and the phase marked truncated) once the box is spent."""
        if self.left() > 0:
            return False
        self.result["truncated"] = True
        return True

    def check(self, name: str, passed: bool, detail=None) -> bool:
        self.result.setdefault("checks", {})[name] = {"ok": bool(passed), "detail": detail}
        if not passed:
            self.log(f"  FAILED {name}: {detail}")
        return bool(passed)


def _status(result: dict, alive: bool, error: str | None) -> str:
    if error is not None:
        return "error"
    if alive or result.get("truncated"):
        return "timeout"
    if result.get("skipped"):
        return "skipped"
    checks = result.get("checks", {})
    return "failed" if any(not c["ok"] for c in checks.values()) else "ok"


def run_phase(phase: Phase, ctx: PhaseContext, box_s: float) -> dict:
    """Run one phase within box_s seconds; its report (status, seconds, results)."""
    error: list[str] = []

    def target():
        try:
            phase.run(ctx)
        except Exception as exc:  # reported, and the next phase runs
            error.append(f"{type(exc).__name__}: {exc}")
            ctx.result["traceback"] = traceback.format_exc(limit=8)

    t0 = time.monotonic()
    worker = threading.Thread(target=target, name=f"gpu-check-{phase.name}", daemon=True)
    worker.start()
    worker.join(box_s)
    alive = worker.is_alive()
    report = {"status": _status(ctx.result, alive, error[0] if error else None),
              "seconds": round(time.monotonic() - t0, 3), "box_s": round(box_s, 1),
              "about": phase.about}
    if error:
        report["error"] = error[0]
    if alive:
        report["error"] = f"still running after its {box_s:.0f} s box; left behind"
    report["results"] = _snapshot(ctx.result)
    return report


def _snapshot(result: dict) -> dict:
    """A copy of a phase's results (an overrunning phase may still be writing to them)."""
    for _ in range(5):
        try:
            return copy.deepcopy(result)
        except RuntimeError:  # changed size during the copy
            time.sleep(0.01)
    return {"unreadable": "the phase kept writing its results"}


def run_all(phases: list[Phase], make_ctx: Callable[[float], PhaseContext],
            box_scale: float, log: Callable[[str], None]) -> dict[str, dict]:
    """Every phase in order; {name: report}."""
    reports: dict[str, dict] = {}
    for i, phase in enumerate(phases, 1):
        box = phase.box_s * box_scale
        log(f"[{i}/{len(phases)}] {phase.name} (box {box:.0f} s): {phase.about}")
        report = run_phase(phase, make_ctx(time.monotonic() + box), box)
        log(f"[{i}/{len(phases)}] {phase.name}: {report['status']} in {report['seconds']:.1f} s"
            + (f" ({report['error']})" if "error" in report else ""))
        reports[phase.name] = report
    return reports
