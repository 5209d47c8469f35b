"""Cost profiles: what a verifier step, a draft step and the network hop cost, as measured
curves (`tandem plan calibrate`, this host) or a stated roofline (tools/plan/roofline.py, GPUs
not at hand). One JSON file each; built-ins live in tools/plan/profiles/.

Units: ms for times, tokens for sizes, bytes for payloads.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILES_DIR = Path(__file__).parent / "profiles"


def _curve(raw: dict) -> dict[int, float]:
    """A {size: ms} curve from JSON (keys come back as strings), checked."""
    out = {int(k): float(v) for k, v in raw.items()}
    bad = {k: v for k, v in out.items() if k < 1 or not math.isfinite(v) or v < 0}
    if bad:
        raise ValueError(f"a cost curve needs sizes >= 1 and finite ms >= 0, got {bad}")
    return dict(sorted(out.items()))


def interpolate(curve: dict[int, float], x: float) -> float:
    """Piecewise linear through the points; flat below the first; the last segment's slope
    (never negative) beyond the last: a compute-bound forward grows linearly."""
    pts = sorted(curve.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0]
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


@dataclass(frozen=True)
class Profile:
    """One deployment's costs. verify_ms: a verifier step's forward by the tokens it runs
    (all sessions, prefill chunks included); kv_ms_per_ktok: extra ms per 1000 cached tokens
    the step's sessions attend over; step_overhead_ms / seq_overhead_ms: per step and per
    session (sampling, rejection, Python); draft_ms: one draft step by its batch (sessions,
    one token each); net_latency_ms: one way, verifier <-> draft worker; net_gbps with
    feature_bytes_per_token: what EAGLE's features add per committed token; gateway_ms: the
    gateway's own share of TTFT (tokenize, route, Redis); kv_tokens: KV capacity per
    verifier in tokens; colocated_draft: drafts run on the verifier's own device (EAGLE
    head on the target's GPU), so their steps delay its steps. prefill_ms: a cold prompt's
    forward by its tokens (nothing cached: `tandem plan validate`'s warm-up times them), for
    steps of cold prefills only (empty: verify_ms); batch_ms: a step of b sessions x 1 token
    as calibrated (what batch_extra_ms was derived from); reuse_hold_ms: how much later the
    first bytes of a response reach a client that sends its next request on the kept-alive
    connection the previous one just finished on (a closed-loop client; validate measures it;
    negative: sooner, the connect saved)."""

    name: str
    source: str  # how the numbers were obtained: "measured on ...", "roofline ..."
    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=lambda: {1: 5.0})
    kv_ms_per_ktok: float = 0.0
    step_overhead_ms: float = 0.5
    seq_overhead_ms: float = 0.1
    net_latency_ms: float = 0.5
    net_gbps: float = 10.0
    feature_bytes_per_token: int = 0
    gateway_ms: float = 2.0
    kv_tokens: int = 65_536
    block_size: int = 16
    colocated_draft: bool = False
    # Extra ms of a step by its sessions beyond one session's forward over as many tokens
    # (attention and bookkeeping per sequence): b sessions x 1 token minus 1 x b tokens.
    batch_extra_ms: dict[int, float] = field(default_factory=lambda: {1: 0.0})
    prefill_ms: dict[int, float] = field(default_factory=dict)
    batch_ms: dict[int, float] = field(default_factory=dict)
    reuse_hold_ms: float = 0.0
    price_verifier_hr: float = 0.0  # $ per verifier pod hour (sizing reports)
    price_draft_hr: float = 0.0
    notes: str = ""

    def __post_init__(self):
        object.__setattr__(self, "verify_ms", _curve(self.verify_ms))
        object.__setattr__(self, "draft_ms", _curve(self.draft_ms))
        object.__setattr__(self, "batch_extra_ms", _curve(self.batch_extra_ms or {1: 0.0}))
        object.__setattr__(self, "prefill_ms", _curve(self.prefill_ms))
        object.__setattr__(self, "batch_ms", _curve(self.batch_ms))
        if not self.verify_ms or not self.draft_ms:
            raise ValueError("a profile needs at least one point of verify_ms and draft_ms")
        for name in ("kv_ms_per_ktok", "step_overhead_ms", "seq_overhead_ms", "net_latency_ms",
                     "gateway_ms", "price_verifier_hr", "price_draft_hr"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"profile {name} must be >= 0, got {getattr(self, name)}")
        if not self.reuse_hold_ms >= -self.gateway_ms:  # a reused connection saves its connect
            raise ValueError(f"profile reuse_hold_ms must be >= -gateway_ms, got "
                             f"{self.reuse_hold_ms}")
        if self.net_gbps <= 0 or self.kv_tokens < 1 or self.block_size < 1:
            raise ValueError(f"profile needs net_gbps > 0, kv_tokens >= 1, block_size >= 1, "
                             f"got {self.net_gbps}, {self.kv_tokens}, {self.block_size}")

    def step_ms(self, tokens: int, seqs: int, context_tokens: int) -> float:
        """One verifier step: `tokens` new tokens over `seqs` sessions attending over
        `context_tokens` cached tokens in all (none: cold prefills, the prefill curve's)."""
        forward = self.prefill_ms if self.prefill_ms and not context_tokens else self.verify_ms
        return (interpolate(forward, tokens) + interpolate(self.batch_extra_ms, seqs)
                + self.step_overhead_ms + self.seq_overhead_ms * seqs
                + self.kv_ms_per_ktok * context_tokens / 1e3)

    def draft_step_ms(self, batch: int) -> float:
        return interpolate(self.draft_ms, batch)

    def hop_ms(self, payload_bytes: int = 0) -> float:
        """One way over the network with this payload (Gbit/s -> bytes per ms: gbps * 1.25e5)."""
        return self.net_latency_ms + payload_bytes / (self.net_gbps * 1.25e5)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> Profile:
        known = set(cls.__dataclass_fields__)
        extra = set(raw) - known
        if extra:
            raise ValueError(f"unknown profile fields: {sorted(extra)}")
        return cls(**raw)


def load_profile(spec: str) -> Profile:
    """A profile by file path, or by the name of a built-in (tools/plan/profiles/NAME.json)."""
    path = Path(spec)
    if not path.exists():
        path = PROFILES_DIR / f"{spec}.json"
    if not path.exists():
        names = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ValueError(f"no profile {spec!r}: not a file, and the built-ins are {names}")
    return Profile.from_json(json.loads(path.read_text()))


def save_profile(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
