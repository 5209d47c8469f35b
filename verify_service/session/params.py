"""What a Generate call asks of the verifier, validated where it enters (the servicer).
Pure Python (no torch)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidArgument
from tandem.grammar.spec import GrammarSpec
from tandem.sampling_params import SamplingParams
from tandem.spec.methods import AUTO_DRAFT_METHODS, Method

MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass(frozen=True)
class GenerateParams:
    """What a Generate call asks for (validated where it enters: the servicer)."""

    session_id: str
    prompt: tuple[int, ...]
    committed: tuple[int, ...]  # resumed after failover: already generated tokens
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    method: Method = Method.NONE
    num_speculative_tokens: int = 0  # 0 = server default
    draft_address: str = ""
    tenant: str = ""  # passed on to the draft worker (per-tenant suffix caches)
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C headers for the draft's span
    # Medusa's typical acceptance (posterior_threshold, posterior_alpha): LOSSY; None = exact.
    typical: tuple[float, float] | None = None
    # Return each generated token's target logprob, with this many top alternatives; None = no.
    logprobs: int | None = None
    # Draft token trees (medusa, eagle) instead of chains; None: medusa's trees, else chains
    # (the servicer always decides, from the request and the server's --draft-shape).
    tree: bool | None = None
    grammar: GrammarSpec | None = None  # structured output: the text follows it
    # auto only: the model method of the draft worker at draft_address whose drafts auto may
    # also take (verify_service/policy/auto.py); None: auto drafts in the verifier alone.
    auto_draft: Method | None = None
    # Predicted Outputs: the text the client expects, tokenized; a draft only, proposed by the
    # verifier (tandem/proposers/prediction.py) whatever the method. () = none.
    prediction: tuple[int, ...] = ()

    def __post_init__(self):
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                  f"{self.logprobs}")
        if not self.session_id:
            raise InvalidArgument("session_id is empty")
        if not self.prompt:
            raise InvalidArgument("prompt_token_ids is empty")
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.committed) >= self.max_new_tokens:
            raise InvalidArgument(
                f"{len(self.committed)} committed tokens already reach max_new_tokens "
                f"{self.max_new_tokens}"
            )
        if not isinstance(self.method, Method) or self.method is Method.UNSPECIFIED:
            raise InvalidArgument(f"unknown speculation method {self.method!r}")
        if self.num_speculative_tokens < 0:
            raise InvalidArgument(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.tree is None:
            object.__setattr__(self, "tree", self.method is Method.MEDUSA)
        if self.tree and not self.method.can_tree:
            raise InvalidArgument("draft_shape tree applies to methods medusa, eagle and auto, "
                                  f"not {self.method.api_name}")
        if self.typical is not None:
            threshold, alpha = self.typical
            if not (0 < threshold <= 1 and 0 <= alpha <= 1):
                raise InvalidArgument(
                    "typical_acceptance needs posterior_threshold in (0, 1] and "
                    f"posterior_alpha in [0, 1], got {threshold} and {alpha}")
            if self.method is not Method.MEDUSA:
                raise InvalidArgument("typical_acceptance applies to the medusa method only, "
                                      f"not {self.method.api_name}")
        if self.auto_draft is not None and (self.method is not Method.AUTO or
                                            self.auto_draft not in AUTO_DRAFT_METHODS):
            raise InvalidArgument(f"auto_draft_method {self.auto_draft!r} needs method auto "
                                  f"and draft_model or eagle, not {self.method.api_name}")
