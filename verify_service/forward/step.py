"""What the engine hands the executor for one verification step, and what comes back: a
StepInput per session in, a RoundOutcome per session and the step's StepTimings out.

Immutable snapshots: the executor runs them on its worker thread while the event loop goes
on (verify_service/engine.py builds them, verify_service/forward/executor.py runs them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.tree_rejection import is_chain
from tandem.engine.model_runner import SeqChunk
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Features


@dataclass(frozen=True)
class History:
    """What the sampling controls read of a session (SamplingParams.has_controls): its
    prompt and committed output before the round, and the stop token ids min_tokens bans."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class StepInput:
    """One session's verification input: a chain of drafts, or a tree when `parents` describes
    one (index of each draft's parent among the drafts, -1 = the round's root)."""

    token_ids: list[int]  # [last committed token, *drafts], a prefill chunk, or carried: drafts
    start_pos: int
    block_table: list[int]
    drafts: list[DraftToken]  # the k draft tokens under verification
    sampling: SamplingParams
    carried: torch.Tensor | None = None  # [vocab] target probs of the first draft's position
    sample_bonus: bool = True  # False: if all drafts pass, carry the bonus row instead
    parents: tuple[int, ...] | None = None  # None = a chain
    want_features: bool = False  # EAGLE sessions: return the kept positions' hidden states
    propose_tree: int = 0  # Medusa sessions: nodes of the next round's tree drafted now
    propose_chain: bool = False  # ... a chain of the heads' top-1 tokens instead
    typical: tuple[float, float] | None = None  # LOSSY typical acceptance (threshold, alpha)
    logprobs: int | None = None  # the emitted tokens' target logprobs, with this many top
    partial: bool = False  # a prefill chunk before the last: computes KV, samples nothing
    prefill: bool = False  # a prompt's last (or only) chunk: features of all of it, if wanted
    # Structured output: [k + 1, ceil(vocab / 32)] int32 grammar bitmasks of the root and each
    # draft's position (tandem.grammar.state); None = free text.
    mask: torch.Tensor | None = None
    # The sampling controls' view of the session (None: it has none): each verified row is
    # processed over this history and the drafts before it on its path (forward/controls.py)
    history: History | None = None

    def __post_init__(self):
        if self.logprobs is not None and self.carried is not None:
            raise ValueError("logprobs need the round's own logits: no carried row")
        if self.parents is not None:
            if len(self.parents) != len(self.drafts):
                raise ValueError(f"{len(self.parents)} parents for {len(self.drafts)} drafts")
            if self.is_tree and (self.carried is not None or not self.sample_bonus):
                raise ValueError("a token tree is verified from its root: no carried row")

    @property
    def is_tree(self) -> bool:
        return not is_chain(self.parents)

    def chunk(self) -> SeqChunk:
        """The forward's view: the new tokens, with the tree's shape (root first) if any."""
        parents = None
        if self.is_tree:
            parents = (-1, *(p + 1 for p in self.parents))
        return SeqChunk(self.token_ids, self.start_pos, self.block_table,
                        num_logits=self.num_logits, parents=parents)

    @property
    def num_logits(self) -> int:
        """Rows of the forward's logits this input gets (its drafts', plus the root's
        unless carried; none for a prefill chunk or an input that runs no forward)."""
        if self.partial or not self.token_ids:
            return 0
        return len(self.drafts) + (self.carried is None)

    @property
    def first_sampled_pos(self) -> int:
        """Absolute position of the first token this round may emit."""
        return self.start_pos + len(self.token_ids) - len(self.drafts)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's raw log-probability of one emitted token (log-softmax of its logits,
    before the sampling parameters) and the `top` most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RoundOutcome:
    accepted: list[int]  # accepted draft tokens
    next_token: int | None  # recovered (first rejection) or bonus token; None when carried
    carry: torch.Tensor | None = None  # [vocab] the unsampled bonus row, when next_token is None
    features: Features | None = None  # hidden states of the positions whose KV was kept
    tree: tuple[list[DraftToken], tuple[int, ...]] | None = None  # Medusa: next round's drafts
    logprobs: tuple[TokenLogprob, ...] = ()  # one per emitted token, when asked for


@dataclass(frozen=True)
class StepTimings:
    forward_ms: float
    rejection_ms: float  # everything after the forward: sampling, rejection, the heads' pass
    heads_ms: float = 0.0  # of which the Medusa heads' pass (0: none ran)
