"""A round's metrics (tandem.telemetry.VerifierMetrics.observe_round): the per-position and
per-phase children are looked up once and reused, and still count what each round says."""
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.telemetry import VerifierMetrics, render

pytestmark = pytest.mark.unit


def samples(metrics: VerifierMetrics) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(render(metrics.registry).decode())
            for s in f.samples}


def test_accepted_positions_and_phases_count_every_round():
    m = VerifierMetrics(num_positions=2)
    m.observe_round(4, 3, 1.0, 20.0, 0.5)  # positions 0, 1, 2 accepted
    m.observe_round(4, 1, 3.0, 30.0, 0.5)  # position 0
    m.observe_round(0, 0, 0.0, 25.0, 0.5)  # a plain round: no drafts
    got = samples(m)
    ours = "tandem_spec_num_accepted_tokens_per_pos_total"
    assert [got[(ours, (("position", str(p)),))] for p in range(3)] == [2.0, 1.0, 1.0]
    assert (ours, (("position", "3"),)) not in got  # a position nobody reached is not made
    vllm = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    labels = (("engine", "0"), ("model_name", "tandem"))
    assert [got[(vllm, tuple(sorted((*labels, ("position", str(p))))))] for p in range(3)] \
        == [2.0, 1.0, 1.0]
    phase = "tandem_round_phase_seconds"
    assert got[(phase + "_count", (("phase", "verify"),))] == 3.0
    assert got[(phase + "_sum", (("phase", "verify"),))] == pytest.approx(0.075)
    assert got[(phase + "_sum", (("phase", "draft_wait"),))] == pytest.approx(0.004)
    assert got[("tandem_verifier_rounds_total", ())] == 3.0
