"""The profile `tandem plan validate` simulates its cells with: the calibration's curves, their
level and the batch's cost from the verifier's own steps during the run, the cold prefills of
the run's warm-up, and the overheads its warm passes measured (out/overhead.json)."""
from __future__ import annotations

import dataclasses
import statistics

from tools.plan.profile import Profile, interpolate, load_profile
from verify_service.policy.calibration import STEP_CALIBRATION_COUNTS


def by_load(rounds: list[dict], loads: list[str]) -> dict[str, list[dict]]:
    """The method none's rounds by load: their "load" key, or (older files) the cells' order,
    every none cell having run the same requests and tokens (one round per token)."""
    none = [r for r in rounds if r["method"] == "none"]
    if all("load" in r for r in none):
        return {ld: [r for r in none if r["load"] == ld] for ld in loads}
    n = len(none) // max(1, len(loads))
    return {ld: none[i * n:(i + 1) * n] for i, ld in enumerate(loads)}


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit (pool adjacent violators): a forward over more
    tokens or sessions never costs less, so a calibrated point below an earlier one is noise
    (2026-11-28: 4 tokens 30.6 ms, 5 tokens 25.9 ms) and is pooled with its neighbours."""
    blocks: list[list] = []  # [mean, count, keys]
    for q in sorted(curve):
        blocks.append([curve[q], 1, [q]])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1, k1), (m2, n2, k2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2, k1 + k2])
    return {q: m for m, _, keys in blocks for q in keys}


def with_prefills(verify: dict[int, float], prefills: list[dict],
                  above: int = 31) -> dict[int, float]:
    """The curve above `above` tokens replaced by the warm-up's cold prefills (ms by prompt
    tokens, median per size, never falling with size), when there are 3 sizes or more."""
    by: dict[int, list[float]] = {}
    for p in prefills:
        if p.get("verify_ms") and p["prompt_tokens"] > above:
            by.setdefault(p["prompt_tokens"], []).append(p["verify_ms"])
    if len(by) < 3:
        return verify
    small = {q: ms for q, ms in verify.items() if q <= above}
    out, top = dict(small), max(small.values(), default=0.0)
    for q in sorted(by):
        top = max(top, statistics.median(by[q]))
        out[q] = top
    # beyond the longest prompt: the least-squares slope over them all, not the last pair's
    pts = [(q, statistics.median(ms)) for q, ms in by.items()]
    mq, mm = statistics.mean(q for q, _ in pts), statistics.mean(m for _, m in pts)
    var = sum((q - mq) ** 2 for q, _ in pts) or 1.0
    slope = max(0.0, sum((q - mq) * (m - mm) for q, m in pts) / var)
    q_max = max(by)
    out[max(2048, 2 * q_max)] = top + slope * (max(2048, 2 * q_max) - q_max)
    return out


def calibrated_batch(base: Profile) -> dict[int, float]:
    """b sessions x 1 token as calibrated (base.batch_ms; older profiles: base.verify_ms +
    base.batch_extra_ms)."""
    return dict(base.batch_ms) or {b: interpolate(base.verify_ms, b) + ms
                                   for b, ms in base.batch_extra_ms.items()}


def closed_ratios(base: Profile, step: dict[str, float], scale: float) -> dict[int, float]:
    """How much slower the run's own none steps were than the calibrated batch curve at the
    closed loads that measured them (c=1: scale; c=4, c=16: their median verify_ms)."""
    cal, ratio = calibrated_batch(base), {1: scale}
    for ld, ms in step.items():
        if ld.startswith("c=") and ld != "c=1":
            ratio[int(ld[2:])] = ms / interpolate(cal, int(ld[2:]))
    return ratio


def load_steps(rounds: list[dict], load: str, least: int = 10) -> dict[int, float]:
    """The median verify_ms of the none cell's steps of b sessions at this load, for each b
    with `least` steps or more: a step's rounds share its verify_ms; steps with a request's
    first round (a prompt's prefill) left out."""
    steps: dict[float, list[dict]] = {}
    for r in rounds:
        if r["method"] == "none" and r.get("load") == load:
            steps.setdefault(r["verify_ms"], []).append(r)
    by: dict[int, list[float]] = {}
    for ms, rs in steps.items():
        if all(r.get("round") != 1 for r in rs):
            by.setdefault(len(rs), []).append(ms)
    return {b: statistics.median(v) for b, v in sorted(by.items()) if len(v) >= least}


def batch_extra(base: Profile, verify: dict[int, float],
                ratio: dict[int, float]) -> dict[int, float]:
    """What b sessions x 1 token cost beyond `verify` at b tokens: the calibrated batch curve
    times how much slower the run's own none steps were than it (ratio by sessions), that
    ratio linear in b between them (the gateway's and the client's work per stream takes more
    of the host's cores as streams are added)."""
    cal = calibrated_batch(base)
    sizes = sorted({*cal, *ratio})
    run = monotone({b: interpolate(cal, b) * _flat(ratio, b) for b in sizes})
    return {b: max(0.0, ms - interpolate(verify, b)) for b, ms in run.items()}


def _flat(curve: dict[int, float], x: float) -> float:
    """Piecewise linear through the points, flat beyond both ends."""
    pts = sorted(curve.items())
    if x >= pts[-1][0]:
        return pts[-1][1]
    return interpolate(curve, x)


def run_profile(profile_name: str, rounds: list[dict], loads: list[str],
                prefills: list[dict] = (), overhead: dict | None = None,
                load: str = "") -> Profile:
    """The calibrated curve's SHAPE (made monotone), its LEVEL from the verifier's own none
    steps at one session during the run, the batch's cost by sessions from the calibrated
    batch curve levelled by the run's none steps at each load (batch_extra), the cold
    prefills as the prefill curve, the median rejection_ms plus the measured per-step gap as
    the step's work beyond the forward, and the measured gateway share and connection hold.
    For an open `load` (Poisson arrivals) the level and the batch's cost come from that load's
    own none steps by sessions (load_steps) when they have one-session steps. A host shared
    with other jobs swings too much between a calibration and a run for the calibration's
    level to hold."""
    base, overhead = load_profile(profile_name), overhead or {}
    step = {ld: statistics.median(r["verify_ms"] for r in rs)
            for ld, rs in by_load(rounds, loads).items() if rs}
    if "c=1" not in step:
        return base
    scale = step["c=1"] / interpolate(base.verify_ms, 1)
    ratio = closed_ratios(base, step, scale)
    own = load_steps(rounds, load) if load and not load.startswith("c=") else {}
    if 1 in own:  # an open load: its own none steps by sessions, not the closed loads'
        scale = own[1] / interpolate(base.verify_ms, 1)
        cal = calibrated_batch(base)
        ratio = {1: scale, **{b: ms / interpolate(cal, b) for b, ms in own.items() if b > 1}}
    verify = monotone({q: ms * scale for q, ms in base.verify_ms.items()})
    prefill = with_prefills(verify, prefills)
    # beyond the verifier's own calibration (STEP_CALIBRATION_COUNTS: up to 64 tokens) the
    # run's cold prefills, not calibrate's extension to prefill sizes
    verify = with_prefills(verify, prefills, above=max(STEP_CALIBRATION_COUNTS))
    extra = batch_extra(base, verify, ratio)
    rej = [r["rejection_ms"] for r in rounds if r.get("rejection_ms")]
    per_step = (statistics.median(rej) if rej else base.step_overhead_ms) + \
        (overhead.get("step_gap_ms") or 0.0)
    return dataclasses.replace(
        base, verify_ms=verify, batch_extra_ms=extra, seq_overhead_ms=0.0,
        prefill_ms=prefill if prefill is not verify else {},
        step_overhead_ms=round(per_step, 3),
        gateway_ms=round(overhead.get("gateway_ms") or base.gateway_ms, 3),
        reuse_hold_ms=round(overhead.get("reuse_hold_ms") or 0.0, 3),
        source=f"{base.source}; {load or 'closed loads'}: scaled x{scale:.2f}, batch extra "
               f"{ {b: round(v, 1) for b, v in extra.items()} } from the run's own none steps "
               f"(verify_ms median by load: {({k: round(v, 1) for k, v in step.items()})}"
               f"{_own_note(load, own)}); "
               f"overheads {overhead}")


def _own_note(load: str, own: dict[int, float]) -> str:
    if 1 not in own:
        return ""
    return f"; {load} steps by sessions: { {b: round(v, 1) for b, v in own.items()} }"


def cell_speed(rounds: list[dict], method: str, load: str) -> float:
    """How much slower the verifier's plain forwards ran in this cell than in the none cell of
    the same load (the lower quartile of their verify_ms, so that the prefill rounds among
    them do not count): the host's drift (other jobs; a draft worker on the same cores),
    which the cell's own rounds measure. 1.0 without such rounds."""
    def med(m):
        xs = [r["verify_ms"] for r in rounds
              if r["method"] == m and r.get("load") == load and r["drafted"] == 0]
        return statistics.quantiles(xs, n=4)[0] if len(xs) >= 4 else None
    mine, base = med(method), med("none")
    return mine / base if mine and base else 1.0


def slowed(profile: Profile, speed: float) -> Profile:
    """The profile's device costs (forwards, batch extra, draft steps) times speed."""
    if speed == 1.0:
        return profile
    return dataclasses.replace(
        profile, verify_ms={q: ms * speed for q, ms in profile.verify_ms.items()},
        prefill_ms={q: ms * speed for q, ms in profile.prefill_ms.items()},
        batch_extra_ms={b: ms * speed for b, ms in profile.batch_extra_ms.items()},
        draft_ms={b: ms * speed for b, ms in profile.draft_ms.items()})
