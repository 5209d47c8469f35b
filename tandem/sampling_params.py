"""Per-request sampling parameters (pure Python: the scheduler and gateway import this)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.errors import InvalidArgument

_MAX_SEED = 2**63  # exclusive; seeds travel as int64 on the wire
# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to
# inf and the row's softmax turns NaN. kernels.sampling applies the same threshold.
MIN_TEMPERATURE = 1e-5
# Above this the distribution is uniform to float32 precision anyway, and a larger value (1e300)
# would become inf in a float32 tensor, which the sampling kernels refuse for the whole batch.
MAX_TEMPERATURE = 1e4


def _is_int(x: object) -> bool:
    # bool is an int subclass; reject it so `top_k=True` does not silently mean 1
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature == 0 means greedy (argmax), and so does any temperature below MIN_TEMPERATURE
    (stored as 0); top_k == 0 and top_p == 1 switch those filters off.
    A seed makes the request's tokens reproducible whatever else shares its batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not (_is_real(t) and math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                             f"got {t!r}")
        if not (_is_int(k) and k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        if not (_is_real(p) and 0.0 < p <= 1.0):  # the comparison also rejects NaN
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        if seed is not None and not (_is_int(seed) and 0 <= seed < _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}")
        if t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen: normalise once, here

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    # ---- the wire (tandem.v1.SamplingParams): the one conversion, both ways ---------------
    @staticmethod
    def wire_fields(msg) -> tuple[float, int, float, int | None]:
        """A tandem.v1.SamplingParams message's (temperature, top_k, top_p, seed), unchecked
        (a draft worker reports a bad value in-band, for its session only)."""
        # top_p 0 is proto3's "unset", which means off, like 1; anything else is checked
        return (msg.temperature, msg.top_k, msg.top_p if msg.top_p != 0 else 1.0,
                msg.seed if msg.HasField("seed") else None)

    @classmethod
    def from_wire(cls, msg) -> SamplingParams:
        """The message's params; InvalidArgument says which value is wrong."""
        try:
            return cls(*cls.wire_fields(msg))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def to_wire(self) -> dict:
        """Keyword arguments of the tandem.v1.SamplingParams message (no seed: unseeded)."""
        fields = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return fields if self.seed is None else {**fields, "seed": self.seed}
