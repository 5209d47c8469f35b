"""OpenAI request models (pydantic, strict types) and response/chunk builders.

Requests are parsed strictly: "10" is not an int and true is not 1, so a client's type bug
comes back as a 400 naming the field instead of silently meaning something else. Fields the
gateway cannot honour are refused, never ignored: gateway/fields.py answers every field the
models do not declare (a no-op, a default-only value, or "Unrecognized request argument").
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The response builders live in gateway/bodies.py; re-exported for existing callers.
from gateway.bodies import (  # noqa: F401
    chat_choice,
    chat_response,
    completion_choice,
    completion_response,
    response_body,
    round_chunk,
    speculation_stats,
    stream_chunk,
    usage_chunk,
    usage_dict,
)
from gateway.errors import bad_request
from gateway.logprobs import MAX_TOP_LOGPROBS
from gateway.prediction import Prediction
from gateway.sampling_options import SamplingFields
from gateway.structured_models import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolCallFunction,
)
from tandem.spec.methods import API_NAMES

# Sorted, so a bad method's 400 lists the choices alphabetically.
_METHOD_NAMES = tuple(sorted(API_NAMES))
_MAX_SEED = 2**63  # seeds travel as uint64 on the wire; int64 keeps every language happy
_MAX_STOP_STRINGS = 16
# Beyond this many stop token ids a request is refused: each travels with every resume.
_MAX_STOP_TOKEN_IDS = 64

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TypicalAcceptance(BaseModel):
    """Medusa's typical acceptance: LOSSY (see docs/design/medusa.md); the response says so."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    posterior_threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.09
    posterior_alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.3


class SpeculationOptions(BaseModel):
    """The `speculation` extension: which proposer and how many draft tokens per round."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal[_METHOD_NAMES] | None = None  # a Method.api_name; the plan parses it
    num_speculative_tokens: Annotated[int, Field(ge=0)] | None = None
    typical_acceptance: TypicalAcceptance | None = None  # medusa only; None = lossless
    # Medusa and eagle: a token tree per round or a chain; None = the verifier's default.
    draft_shape: Literal["tree", "chain"] | None = None
    # Streaming only: one extra chunk per verification round (empty choices, a
    # `speculation_round` object) so a client can watch acceptance live.
    events: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] | None = None  # vLLM's; only off is served


class GenerationRequest(SamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions (the sampling controls,
    n and best_of come from SamplingFields)."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=_MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: SpeculationOptions | None = None
    prediction: Prediction | None = None  # Predicted Outputs (gateway/prediction.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' json / regex / choice / grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False  # the prompt's text before each choice's


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # "function": the legacy spelling of a tool turn (with `functions`), read as "tool"
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's earlier calls
    tool_call_id: str | None = None  # a tool turn: which call it answers
    function_call: ToolCallFunction | None = None  # legacy: an assistant turn's one call

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # As OpenAI: only an assistant turn may omit its content (it then carried tool calls).
        if self.content is None and self.role != "assistant":  # (which may carry tool calls)
            raise ValueError(f"content is required for a {self.role} message")
        if self.function_call is not None and not self.tool_calls:
            self.tool_calls = [ToolCall(function=self.function_call)]
        if self.role == "function":
            self.role = "tool"
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The legacy spelling of tools / tool_choice (map_functions turns them into those).
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None

    def map_functions(self) -> None:
        """functions / function_call as tools / tool_choice (one call at a time, as the
        legacy API returned); the answer comes back as tool_calls."""
        if self.functions is None:
            if self.function_call is not None:
                raise bad_request("function_call: requires functions", param="function_call")
            return
        if self.tools is not None or self.tool_choice is not None:
            raise bad_request("functions: give tools or functions, not both", param="functions")
        self.tools = [Tool(type="function", function=f) for f in self.functions]
        fc = self.function_call
        self.tool_choice = (NamedToolChoice(type="function", function=fc)
                            if isinstance(fc, FunctionName) else fc)
        if self.parallel_tool_calls is None:
            self.parallel_tool_calls = False

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
        # Earlier tool calls are shown as the text the model wrote for them (gateway/tools.py).
        from gateway.tools import message_text

        return [{"role": "system" if m.role == "developer" else m.role,
                 "content": message_text(m)} for m in self.messages]


def check_common(req: GenerationRequest, *, max_spec_tokens: int) -> None:
    """Checks that pydantic cannot express; each raises a 400 naming the field."""
    if isinstance(req, ChatCompletionRequest):
        req.map_functions()
    stops = req.stop_strings()
    if any(not s for s in stops):
        raise bad_request("stop: stop strings must be non-empty", param="stop")
    if len(stops) > _MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {_MAX_STOP_STRINGS} stop strings", param="stop")
    if req.stop_token_ids and len(req.stop_token_ids) > _MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids: at most {_MAX_STOP_TOKEN_IDS} ids, got "
                          f"{len(req.stop_token_ids)}", param="stop_token_ids")
    spec = req.speculation
    if spec and spec.events and not req.stream:
        raise bad_request("speculation.events: per-round events need stream: true",
                          param="speculation.events")
    if spec and spec.num_speculative_tokens is not None and (
            spec.num_speculative_tokens > max_spec_tokens):
        raise bad_request(
            f"speculation.num_speculative_tokens must be in [0, {max_spec_tokens}], "
            f"got {spec.num_speculative_tokens}", param="speculation.num_speculative_tokens")
    if getattr(req, "echo", False) and req.logprobs is not None:
        raise bad_request("echo: with logprobs it needs the prompt's logprobs, which this "
                          "server does not compute", param="echo", code="unsupported_value")


def prompt_token_ids(req: CompletionRequest | ChatCompletionRequest, tokenizer: Any,
                     system: str = "") -> tuple[list[int], str]:
    """Token ids of the prompt, and the text that identifies the conversation (affinity).
    `system`: what the server adds to the system message (the tools' description)."""
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise bad_request("messages: must be a non-empty list", param="messages")
        msgs = req.template_messages()
        if system and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": f"{msgs[0]['content']}\n\n{system}"}
        elif system:
            msgs.insert(0, {"role": "system", "content": system})
        try:
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        except Exception as exc:  # jinja raises its own types; any failure is the input's
            raise bad_request(f"messages: chat template failed: {exc}", param="messages") from None
        firsts = [m["content"] for m in msgs if m["role"] == "system"]
        firsts += [m["content"] for m in msgs if m["role"] == "user"][:1]
        return list(ids), "\x00".join(firsts)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("prompt: batched prompts are not supported (send one)",
                              param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt: must be a non-empty string", param="prompt")
        return list(tokenizer(prompt).input_ids), prompt
    if not prompt:
        raise bad_request("prompt: must be non-empty", param="prompt")
    vocab = len(tokenizer)
    if any(t < 0 or t >= vocab for t in prompt):
        raise bad_request(f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return list(prompt), " ".join(map(str, prompt[:128]))


def echo_text(req: GenerationRequest, prompt_ids: tuple[int, ...], tokenizer: Any) -> str:
    """completions' echo: the prompt as the client sent it (token ids: their text)."""
    if not getattr(req, "echo", False):
        return ""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(list(prompt_ids), skip_special_tokens=req.skip_special_tokens)
