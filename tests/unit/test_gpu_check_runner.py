"""gpu-check's phase runner (tools/gpu_check/runner.py): time boxes, errors and failed checks
are reported and the next phase still runs; the report renders each case."""
import threading
import time

import pytest

from tools.gpu_check import report
from tools.gpu_check.runner import Phase, PhaseContext, run_all

pytestmark = pytest.mark.unit


def _ctx(deadline: float) -> PhaseContext:
    return PhaseContext("cpu", True, deadline, {}, lambda m: None)


def test_boxes_errors_and_checks_are_reported_and_the_next_phase_runs():
    release = threading.Event()

    def hangs(ctx):
        ctx.result["partial"] = 1
        release.wait(5)

    def stops_itself(ctx):
        while not ctx.out_of_time():
            time.sleep(0.01)

    def raises(ctx):
        raise RuntimeError("boom")

    def fails(ctx):
        ctx.check("a", True)
        ctx.check("b", False, 0.5)

    def fine(ctx):
        ctx.check("a", True)
        ctx.result["figure"] = 3

    phases = [Phase("hangs", 0.2, hangs, "x"), Phase("stops", 0.1, stops_itself, "x"),
              Phase("raises", 1, raises, "x"), Phase("fails", 1, fails, "x"),
              Phase("fine", 1, fine, "x")]
    t0 = time.monotonic()
    got = run_all(phases, _ctx, 1.0, lambda m: None)
    release.set()
    assert time.monotonic() - t0 < 3
    assert {n: r["status"] for n, r in got.items()} == {
        "hangs": "timeout", "stops": "timeout", "raises": "error", "fails": "failed",
        "fine": "ok"}
    assert got["hangs"]["results"]["partial"] == 1 and "box" in got["hangs"]["error"]
    assert got["raises"]["error"] == "RuntimeError: boom"
    assert got["fine"]["results"]["figure"] == 3


def test_box_scale_and_phase_validation():
    seen = []
    run_all([Phase("p", 10, lambda ctx: seen.append(ctx.left()), "x")], _ctx, 0.5,
            lambda m: None)
    assert 4 < seen[0] <= 5
    with pytest.raises(ValueError):
        Phase("p", 0, lambda ctx: None, "x")


def test_markdown_and_json_render_every_status(tmp_path):
    phases = run_all([Phase("correctness", 1, lambda ctx: ctx.check("x", False, 2), "c"),
                      Phase("decode", 1, lambda ctx: 1 / 0, "d")], _ctx, 1.0, lambda m: None)
    summary = {"device_name": "cpu", "torch": "t", "cuda": None, "tiny": True, "total_s": 1.0,
               "all_ok": False, "phases": phases,
               "recommendations": report.recommendations(phases)}
    assert summary["recommendations"]["cuda_graphs_auto_should_enable"] is None
    report.write_json(tmp_path, summary)
    text = report.write_markdown(tmp_path, summary, []).read_text()
    assert "0 of 1 checks passed" in text and "ZeroDivisionError" in text
