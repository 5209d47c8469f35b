"""From a parsed OpenAI request to a `GenerationPlan`: the checks that need the tokenizer, the
config or the live verifiers, and the defaults they fill in."""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from gateway import schemas
from gateway.config import GatewayConfig
from gateway.errors import bad_request, check_chars_fit
from gateway.prediction import prediction_token_ids
from gateway.routing import Router, affinity_key
from gateway.sampling_options import sampling_fields
from gateway.structured import constraint
from gateway.text import TextStream
from gateway.tools import ToolPlan, system_prompt
from tandem.errors import InvalidArgument
from tandem.grammar import GrammarSpec
from tandem.grammar.compiler import LazyCompiler
from tandem.grammar.state import GrammarFailed
from tandem.sampling_params import SamplingParams
from tandem.spec.methods import AUTO_DRAFT_METHODS, Method


@dataclass(frozen=True)
class GenerationPlan:
    """What one request asks the verifiers for (validated by `build_plan`)."""

    session_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    method: Method
    num_speculative_tokens: int
    affinity_key: str | None = None
    tenant: str = ""  # a digest of the API key (auth on), else "": scopes suffix caches
    typical: tuple[float, float] | None = None  # LOSSY typical acceptance (medusa only)
    logprobs: int | None = None  # each token's logprob with this many top ones; None = off
    round_events: bool = False  # stream a speculation_round chunk per verification round
    draft_shape: str | None = None  # "tree" or "chain" (medusa, eagle); None = the verifier's
    grammar: GrammarSpec | None = None  # structured output (gateway/structured.py)
    tools: ToolPlan | None = None  # the tools the text may call (chat)
    prediction_token_ids: tuple[int, ...] = ()  # Predicted Outputs: a draft only
    n: int = 1  # choices returned
    best_of: int = 1  # choices generated (>= n: the n with the highest logprob are kept)


async def build_plan(req: schemas.GenerationRequest, session_id: str, *, config: GatewayConfig,
                     router: Router, tokenizer: Any, grammars: LazyCompiler | None = None,
                     tokenize_in: Executor | None = None, max_token_chars: int = 0
                     ) -> tuple[GenerationPlan, TextStream]:
    """The plan for `req` and the TextStream that turns its tokens into the client's text;
    400 (APIError) for anything the request models alone could not reject. A grammar is
    compiled here (`grammars`), so one that cannot be is a 400 before any token. The prompt
    is tokenized on `tokenize_in` (None: the loop's default pool), never on the event loop,
    unless its text could not fit the context even at `max_token_chars` characters a token."""
    verifiers = await router.verifiers()
    # The live verifiers' limit wins; the config's covers verifiers that report none.
    max_spec = max((v.max_spec_tokens for v in verifiers), default=0)
    schemas.check_common(req, max_spec_tokens=max_spec or config.max_spec_tokens)
    if req.model is not None and req.model != config.model_name:
        raise bad_request(f"model: unknown model {req.model!r}; this server serves "
                          f"{config.model_name!r}", param="model", code="model_not_found")
    grammar, tools = constraint(req)
    if grammar is not None:
        await _check_grammar(grammar, grammars, "tools" if tools else "")
    _check_text_fits(req, config.context_length, max_token_chars)
    ids, conversation = await asyncio.get_running_loop().run_in_executor(
        tokenize_in, schemas.prompt_token_ids, req, tokenizer,
        system_prompt(req.tools, tools) if tools else "")
    max_new = resolve_max_tokens(req, len(ids), config.context_length,
                                         config.default_max_tokens)
    stop_ids = _stop_token_ids(req, tokenizer, config.eos_token_ids)
    prediction = await prediction_token_ids(req.prediction, tokenizer, config.context_length,
                                            max_token_chars, tokenize_in)
    drawn = sampling_fields(req, tokenizer, max_new)  # sampling, n, best_of, logprobs
    spec = req.speculation or schemas.SpeculationOptions()
    method = await _method(spec, router, config.method_preference)
    if spec.draft_shape == "tree" and not method.can_tree:
        raise bad_request(f"speculation.draft_shape 'tree' applies to methods medusa and "
                          f"eagle, not {method.api_name}", param="speculation.draft_shape")
    plan = GenerationPlan(
        session_id=session_id, prompt_token_ids=tuple(ids), **drawn,
        max_new_tokens=max_new, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
        method=method, draft_shape=spec.draft_shape,
        num_speculative_tokens=(spec.num_speculative_tokens
                                if spec.num_speculative_tokens is not None
                                else config.default_speculative_tokens),
        affinity_key=affinity_key(conversation), typical=_typical(spec),
        round_events=spec.events, grammar=grammar, tools=tools,
        prediction_token_ids=prediction)
    return plan, TextStream(tokenizer, req.stop_strings(), stop_ids,
                            include_stop=req.include_stop_str_in_output,
                            skip_special_tokens=req.skip_special_tokens,
                            min_tokens=plan.sampling.min_tokens)


async def _check_grammar(grammar: GrammarSpec, grammars: LazyCompiler | None,
                         param: str) -> None:
    if grammars is None:
        raise bad_request("structured output is not served by this gateway",
                          param=param or None, code="unsupported_parameter")
    try:  # compiled and its first mask tried here, so one that fails never reaches a verifier
        await grammars.state(grammar)
    except GrammarFailed as exc:
        raise bad_request(f"{param or 'grammar'}: cannot be served: {exc}",
                          param=param or None, code="invalid_grammar") from None
    except InvalidArgument as exc:
        raise bad_request(f"{param or 'grammar'}: cannot compile: {exc}",
                          param=param or None, code="invalid_grammar") from None


def _typical(spec: schemas.SpeculationOptions) -> tuple[float, float] | None:
    t = spec.typical_acceptance
    if t is None:
        return None
    if spec.method != Method.MEDUSA.api_name:
        raise bad_request("speculation.typical_acceptance applies to method 'medusa' only",
                          param="speculation.typical_acceptance")
    return (t.posterior_threshold, t.posterior_alpha)


def _stop_token_ids(req: schemas.GenerationRequest, tokenizer: Any,
                    eos_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
    """EOS and the checkpoint's other end-of-reply tokens (unless ignored) plus the request's
    stop_token_ids, without duplicates."""
    vocab = len(tokenizer)
    extra_stops = tuple(req.stop_token_ids or ())
    if any(t >= vocab for t in extra_stops):
        raise bad_request(f"stop_token_ids: ids must be < {vocab}", param="stop_token_ids")
    eos = tokenizer.eos_token_id
    own = () if req.ignore_eos else ((eos,) if eos is not None else ()) + eos_ids
    return tuple(dict.fromkeys(own + extra_stops))


async def _method(spec: schemas.SpeculationOptions, router: Router,
                  preference: tuple[str, ...]) -> Method:
    """The method asked for; by default the first preferred one that is served: auto by every
    verifier (it drafts in the verifier's own step), the others by a live draft worker; else
    none."""
    if spec.method:
        return Method.parse(spec.method)  # cannot fail: the schema allows only API names
    served = {Method.AUTO.api_name, *await _served(router)}
    for name in preference:
        if name in served:
            return Method.parse(name)
    return Method.NONE


async def auto_draft_method(router: Router, preference: tuple[str, ...]) -> Method | None:
    """The model method whose draft worker an auto session is also linked to: the first of
    `preference` that auto may take drafts from (AUTO_DRAFTS) and a live draft worker
    serves; None (auto drafts in the verifier alone) when there is none."""
    served = await _served(router)
    for name in preference:
        if name in AUTO_DRAFTS and name in served:
            return Method.parse(name)
    return None


async def _served(router: Router) -> set[str]:
    """The methods the live draft workers serve."""
    served: set[str] = set()
    for d in await router.drafts():
        served.update(d.methods or _LEGACY_METHODS)
    return served


# What a draft worker that does not advertise its methods serves.
_LEGACY_METHODS = ("draft_model", "ngram")
# The draft workers' model methods auto may take drafts from, by API name.
AUTO_DRAFTS = tuple(m.api_name for m in sorted(AUTO_DRAFT_METHODS))


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token's text can have: the longest vocabulary entry (a
    byte-level token spells one character per byte; a byte-fallback one, more)."""
    return max(map(len, tokenizer.get_vocab()), default=0)


def _check_text_fits(req: schemas.GenerationRequest, context_length: int,
                     max_token_chars: int) -> None:
    """400 for a prompt whose text needs more tokens than the context holds even if every
    token were the longest: a 3 MiB body is refused at once instead of after seconds of
    tokenizing, and never holds up the next tenant's prompt on the tokenizing thread."""
    if not max_token_chars:  # not checked: do not even count
        return
    if isinstance(req, schemas.ChatCompletionRequest):
        chars = sum(len(m.get("content") or "") for m in req.template_messages())
    else:  # a string, or a list of them (token ids need no tokenizing)
        prompt = req.prompt
        texts = [prompt] if isinstance(prompt, str) else [
            p for p in prompt or () if isinstance(p, str)]
        chars = sum(map(len, texts))
    check_chars_fit("prompt", chars, context_length, max_token_chars)


def resolve_max_tokens(req: schemas.CompletionRequest | schemas.ChatCompletionRequest,
                       prompt_len: int, context_length: int, default_max_tokens: int) -> int:
    """Tokens to generate; 400 when the prompt (plus what was asked for) cannot fit."""
    ctx = context_length
    if prompt_len >= ctx:
        raise bad_request(f"prompt: {prompt_len} tokens leave no room in the context length "
                          f"of {ctx} tokens", param="prompt", code="context_length_exceeded")
    chat = isinstance(req, schemas.ChatCompletionRequest)
    asked = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    param = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
    if asked is None:  # chat: the rest of the context; completions: OpenAI's small default
        return ctx - prompt_len if chat else min(default_max_tokens, ctx - prompt_len)
    if prompt_len + asked > ctx:
        raise bad_request(f"{param}: prompt ({prompt_len} tokens) + {param} ({asked}) exceeds "
                          f"the context length of {ctx} tokens", param=param,
                          code="context_length_exceeded")
    return asked
