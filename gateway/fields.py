"""Every top-level request field gets an answer: honoured, accepted as a no-op, or refused.

Honoured fields are the request models' own (gateway/schemas.py, gateway/sampling_options.py).
The rest are listed here, in one place (docs/reference/api.md has the same table):

- NO_OP: accepted with any value, because nothing they can say changes the output (who is
  asking, what to store, billing or scheduling hints);
- DEFAULT_ONLY: accepted only at the value that changes nothing (null always counts); any
  other value is a 400 naming the field;
- anything else is a 400 "Unrecognized request argument supplied: X", as OpenAI answers.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from gateway.errors import bad_request

# Cannot change the output: identity, storage, billing and scheduling hints.
NO_OP = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "priority", "request_id", "cache_salt", "guided_decoding_backend",
})

# Accepted at these values only (OpenAI's and vLLM's defaults); null is always accepted.
_BOTH = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "prompt_logprobs": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "logits_processors": ((),), "vllm_xargs": (),
    "kv_transfer_params": (), "structural_tag": (), "guided_whitespace_pattern": (),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "audio": (),
    "modalities": (("text",),), "prompt_embeds": (),
}
_CHAT = {"echo": (False,), "add_generation_prompt": (True,),
         "continue_final_message": (False,), "add_special_tokens": (False,),
         "documents": (), "chat_template": (), "chat_template_kwargs": (),
         "mm_processor_kwargs": ()}
_COMPLETIONS = {"suffix": ("",), "add_special_tokens": (True,)}
# Why a field is served at its default only, where its name does not say (in the 400).
WHY = MappingProxyType({
    "prompt_logprobs": "the verifier computes no logprobs for prompt tokens",
    "use_beam_search": "no beam search", "length_penalty": "no beam search",
    "logits_processors": "no user code runs in the verifier",
    "echo": "chat has no prompt text to echo",
    "chat_template": "the served chat template is used as it is",
    "reasoning_effort": "the served models do not reason",
})
DEFAULT_ONLY = MappingProxyType({
    "chat": MappingProxyType({**_BOTH, **_CHAT}),
    "completions": MappingProxyType({**_BOTH, **_COMPLETIONS}),
})


def _frozen(value: Any) -> Any:
    """Lists as tuples, so ["text"] compares equal to the ("text",) of the table."""
    return tuple(map(_frozen, value)) if isinstance(value, list) else value


def _is_default(value: Any, allowed: tuple) -> bool:
    if value is None:
        return True
    value = _frozen(value)
    # bool is an int: True must not pass as 1 (length_penalty), nor 1 as True
    return any(value == a and type(value) is type(a) or
               isinstance(a, float) and type(value) is int and value == a for a in allowed)


def check_fields(data: dict, known: frozenset[str], *, chat: bool) -> None:
    """400 for a top-level field that is neither honoured (in `known`) nor accepted here."""
    defaults = DEFAULT_ONLY["chat" if chat else "completions"]
    for name, value in data.items():
        if name in known or name in NO_OP:
            continue
        if name in defaults:
            if not _is_default(value, defaults[name]):
                why = f": {WHY[name]}" if name in WHY else ""
                raise bad_request(f"{name}: not supported by this server (only its default "
                                  f"{_shown(defaults[name])} is accepted){why}", param=name,
                                  code="unsupported_parameter")
            continue
        raise bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                          code="unrecognized_argument")


def _shown(allowed: tuple) -> str:
    import json

    values = ["null", *(json.dumps(list(a) if isinstance(a, tuple) else a) for a in allowed)]
    return " or ".join(values)


def known_fields(model: type) -> frozenset[str]:
    """The names (and aliases) a request model honours."""
    names = set()
    for name, info in model.model_fields.items():
        names.add(info.alias or name)
    return frozenset(names)
