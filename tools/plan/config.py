"""What one simulation runs: the deployment and the traffic (validated here, once)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "ngram", "suffix", "draft_model", "eagle")
HISTORY_METHODS = ("ngram", "suffix")  # drafted in the verifier's own step, no draft worker
LINKED_METHODS = ("draft_model", "eagle")  # drafted by a draft pool over the network


@dataclass(frozen=True)
class Request:
    """One request of the traffic: when it arrives (ms), its prompt and answer lengths
    (tokens), and the conversation it continues (prefix affinity; "" = none)."""

    arrival_ms: float
    prompt_tokens: int
    max_tokens: int
    conversation: str = ""
    prompt_id: int = -1  # requests with the same id send the same prompt (-1: its own)

    def __post_init__(self):
        if self.arrival_ms < 0 or self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"a request needs arrival_ms >= 0, prompt_tokens >= 1 and "
                             f"max_tokens >= 1, got {self}")


@dataclass(frozen=True)
class SimConfig:
    """A deployment under a load. Exactly one of concurrency (closed loop: C clients, each
    sending its next request when the last one ends), rate (open loop: Poisson arrivals, per
    second) or trace (a file of requests) sets the arrivals."""

    verifiers: int = 1
    drafts: int = 1
    method: str = "none"
    num_speculative_tokens: int = 0  # the request's k cap (0 = the verifier's max_spec_tokens)
    max_spec_tokens: int = 16
    concurrency: int = 0
    rate: float = 0.0
    trace: str = ""
    prompt_tokens: int = 256
    max_tokens: int = 128
    requests: int = 100
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    prefill_chunk_tokens: int = 256
    max_draft_wait_ms: float = 25.0
    batch_plan: bool = True
    shared_prefix_tokens: int = 0  # leading prompt tokens every request shares (a system prompt)
    # A fixed set of prompts by their lengths (tokens), sent in turn (request i sends prompt
    # i mod n); empty: every request its own prompt of prompt_tokens. warm_prefixes: the
    # verifiers' prefix caches hold those prompts already (a cluster that has served them).
    prompt_lengths: tuple[int, ...] = ()
    warm_prefixes: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        loads = sum(bool(x) for x in (self.concurrency, self.rate, self.trace))
        if loads != 1:
            raise ValueError("give exactly one of --concurrency, --rate or --trace")
        if self.concurrency < 0 or self.rate < 0:
            raise ValueError(f"--concurrency and --rate must be positive, got "
                             f"{self.concurrency}, {self.rate}")
        for name in ("verifiers", "prompt_tokens", "max_tokens", "requests", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        for name in ("drafts", "num_speculative_tokens", "max_spec_tokens",
                     "prefill_chunk_tokens", "shared_prefix_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got "
                                 f"{getattr(self, name)}")
        if self.method in LINKED_METHODS and self.drafts < 1:
            raise ValueError(f"--method {self.method} needs --drafts >= 1 (a draft pool)")
        if self.max_draft_wait_ms < 0:
            raise ValueError(f"--max-draft-wait-ms must be >= 0, got {self.max_draft_wait_ms}")
        if any(n < 1 for n in self.prompt_lengths):
            raise ValueError(f"prompt lengths must be >= 1, got {self.prompt_lengths}")
        if self.shared_prefix_tokens >= min(self.prompt_lengths or (self.prompt_tokens,)):
            raise ValueError(f"--shared-prefix-tokens {self.shared_prefix_tokens} must be "
                             f"below --prompt-tokens {self.prompt_tokens}")

    @property
    def k_cap(self) -> int:
        """The most drafts a round may verify (request cap within the server's)."""
        if self.method == "none":
            return 0
        return min(self.num_speculative_tokens or self.max_spec_tokens, self.max_spec_tokens)
