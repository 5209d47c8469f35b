"""What a draft worker allows and what it reports: the only draft-specific dataclasses (the
draft-link messages and the proposer interface are tandem.spec's)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS


@dataclass(frozen=True)
class Limits:
    """What a worker allows; per-session values of 0 on the wire fall back to the defaults."""

    vocab_size: int
    max_context_length: int
    max_sessions: int = 256
    max_run_ahead: int = 8  # default per session
    max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS  # = WorkerInfo.max_spec_tokens
    top_n: int = 8
    max_top_n: int = 64
    max_ngram_size: int = 3

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an int >= 1, got {value!r}")
        if self.max_run_ahead > self.max_spec_tokens or self.top_n > self.max_top_n:
            raise ValueError("Limits: a default exceeds its cap (max_spec_tokens, max_top_n)")


@dataclass(frozen=True)
class WorkerStats:
    sessions_open: int
    queue_depth: int  # sessions waiting to be drafted
    tokens_drafted: int
    steps: int
