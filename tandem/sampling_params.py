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
# The controls' bounds (vLLM's, where it has them; caps keep one request's work bounded).
MAX_PENALTY = 2.0  # presence and frequency penalties in [-2, 2]
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # the vocabulary bounds it further, at admission
MAX_BAD_WORDS_TOKENS = 4096
_MAX_TOKEN_ID = 2**31  # exclusive; ids travel as int32


def _is_int(x: object) -> bool:
    # bool is an int subclass; reject it so `top_k=True` does not silently mean 1
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _in(x: object, lo: float, hi: float) -> bool:
    return _is_real(x) and lo <= x <= hi  # the comparison also rejects NaN


def _is_id(x: object) -> bool:
    return _is_int(x) and 0 <= x < _MAX_TOKEN_ID


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature == 0 means greedy (argmax), and so does any temperature below MIN_TEMPERATURE
    (stored as 0); top_k == 0 and top_p == 1 switch those filters off.
    A seed makes the request's tokens reproducible whatever else shares its batch.
    The controls after `seed` are vLLM's, with its defaults meaning "off"; the verifier
    applies them in vLLM's order (verify_service/forward/controls.py): allowed_token_ids,
    bad_words, min_tokens, logit_bias, then the repetition, frequency and presence
    penalties, then temperature, min_p, top_k, top_p.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # [-2, 2], over the output's tokens
    frequency_penalty: float = 0.0  # [-2, 2], times each output token's count
    repetition_penalty: float = 1.0  # (0, 10], over the prompt's and the output's tokens
    min_p: float = 0.0  # [0, 1], relative to the most likely token after temperature
    min_tokens: int = 0  # stop tokens banned until this many were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token allowed
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences never generated

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
        self._check_controls()

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in(getattr(self, name), -MAX_PENALTY, MAX_PENALTY):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got "
                                 f"{getattr(self, name)!r}")
        r = self.repetition_penalty
        if not (_in(r, 0.0, MAX_REPETITION_PENALTY) and r > 0):
            raise ValueError(f"repetition_penalty must be a number in (0, "
                             f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {r!r}")
        if not _in(self.min_p, 0.0, 1.0):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        self._check_token_lists()

    def _check_token_lists(self) -> None:
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(bias)} entries, more than "
                             f"{MAX_LOGIT_BIAS_ENTRIES}")
        for entry in bias:
            if not (isinstance(entry, tuple) and len(entry) == 2 and _is_id(entry[0])
                    and _in(entry[1], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)):
                raise ValueError("logit_bias entries must be (token id >= 0, bias in "
                                 f"[-100, 100]), got {entry!r}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias lists a token id twice")
        ids = self.allowed_token_ids
        if len(ids) > MAX_ALLOWED_TOKEN_IDS or not all(_is_id(t) for t in ids):
            raise ValueError(f"allowed_token_ids must be at most {MAX_ALLOWED_TOKEN_IDS} "
                             "token ids >= 0")
        words = self.bad_words
        if not all(isinstance(w, tuple) and w and all(_is_id(t) for t in w) for w in words):
            raise ValueError("bad_words must be non-empty sequences of token ids >= 0")
        if sum(len(w) for w in words) > MAX_BAD_WORDS_TOKENS:
            raise ValueError(f"bad_words hold more than {MAX_BAD_WORDS_TOKENS} tokens")

    def token_ids(self) -> list[int]:
        """Every token id the controls name (checked against the vocabulary at admission)."""
        return [*(t for t, _ in self.logit_bias), *self.allowed_token_ids,
                *(t for w in self.bad_words for t in w)]

    @property
    def has_controls(self) -> bool:
        """Whether any control besides temperature, top-k, top-p and min-p is on: the
        verifier then processes each position's logits over its own prefix."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.logit_bias
                    or self.allowed_token_ids or self.bad_words)

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

    @staticmethod
    def control_fields(msg) -> dict:
        """The message's controls as keyword arguments, unchecked (repetition_penalty 0 is
        proto3's "unset": off, 1)."""
        return {"presence_penalty": msg.presence_penalty,
                "frequency_penalty": msg.frequency_penalty,
                "repetition_penalty": msg.repetition_penalty or 1.0,
                "min_p": msg.min_p, "min_tokens": msg.min_tokens,
                "logit_bias": tuple(sorted(msg.logit_bias.items())),
                "allowed_token_ids": tuple(msg.allowed_token_ids),
                "bad_words": tuple(tuple(w.token_ids) for w in msg.bad_words)}

    @classmethod
    def from_wire(cls, msg) -> SamplingParams:
        """The message's params; InvalidArgument says which value is wrong."""
        try:
            return cls(*cls.wire_fields(msg), **cls.control_fields(msg))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def to_wire(self) -> dict:
        """Keyword arguments of the tandem.v1.SamplingParams message (no seed: unseeded;
        controls that are off are left unset)."""
        fields = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        if self.seed is not None:
            fields["seed"] = self.seed
        return {**fields, **self.controls_to_wire(self.control_items())}

    def control_items(self) -> tuple[tuple[str, object], ...]:
        """The controls as control_fields' keyword arguments (a draft link's Open)."""
        return (("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
                ("repetition_penalty", self.repetition_penalty), ("min_p", self.min_p),
                ("min_tokens", self.min_tokens), ("logit_bias", self.logit_bias),
                ("allowed_token_ids", self.allowed_token_ids), ("bad_words", self.bad_words))

    @staticmethod
    def controls_to_wire(items) -> dict:
        """control_fields' keyword arguments as the message's (those off left unset)."""
        c = dict(items)
        wire = {"presence_penalty": c.get("presence_penalty", 0.0),
                "frequency_penalty": c.get("frequency_penalty", 0.0),
                "repetition_penalty": 0.0 if c.get("repetition_penalty", 1.0) == 1.0
                else c["repetition_penalty"],
                "min_p": c.get("min_p", 0.0), "min_tokens": c.get("min_tokens", 0),
                "logit_bias": dict(c.get("logit_bias", ())),
                "allowed_token_ids": list(c.get("allowed_token_ids", ())),
                "bad_words": [{"token_ids": list(w)} for w in c.get("bad_words", ())]}
        return {k: v for k, v in wire.items() if v}
