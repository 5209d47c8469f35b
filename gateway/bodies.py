"""OpenAI response bodies and stream chunks (plain dicts: they go straight to JSON)."""
from __future__ import annotations

from tandem.spec.methods import Method


def speculation_stats(method: Method, rounds: int, drafted: int, accepted: int,
                      committed: int, lossy: bool = False) -> dict:
    """The `speculation` extension object of every response (`lossy`: typical acceptance
    was used, so the text is not distributed as the target's)."""
    return {"method": method.api_name, "rounds": rounds, "drafted_tokens": drafted,
            "accepted_tokens": accepted, "lossy": lossy,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": committed / rounds if rounds else 0.0}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(session_id: str, obj: str, created: int, model: str, choices: list) -> dict:
    return {"id": session_id, "object": obj, "created": created, "model": model, "choices": choices}


def completion_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(index: int, text: str, finish: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:  # OpenAI: no content beside the calls
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def response_body(chat: bool, session_id: str, created: int, model: str, choices: list[dict],
                  usage: dict, speculation: dict) -> dict:
    """A whole (stream=false) response with these choices."""
    body = _envelope(session_id, "chat.completion" if chat else "text_completion", created,
                     model, choices)
    return {**body, "usage": usage, "speculation": speculation}


def completion_response(session_id: str, created: int, model: str, text: str, finish: str,
                        usage: dict, speculation: dict, logprobs: dict | None = None) -> dict:
    return response_body(False, session_id, created, model,
                         [completion_choice(0, text, finish, logprobs)], usage, speculation)


def chat_response(session_id: str, created: int, model: str, text: str, finish: str,
                  usage: dict, speculation: dict, logprobs: dict | None = None,
                  tool_calls: list[dict] | None = None) -> dict:
    return response_body(True, session_id, created, model,
                         [chat_choice(0, text, finish, logprobs, tool_calls)], usage,
                         speculation)


def stream_chunk(chat: bool, session_id: str, created: int, model: str, *, text: str | None = None,
                 role: bool = False, finish: str | None = None,
                 logprobs: dict | None = None, index: int = 0) -> dict:
    """One streamed choice: a text delta (with its tokens' logprobs when asked for), the
    assistant role opener, or the finish."""
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _envelope(session_id, "chat.completion.chunk", created, model, [choice])
    choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return _envelope(session_id, "text_completion", created, model, [choice])


def round_chunk(chat: bool, session_id: str, created: int, model: str, event: dict) -> dict:
    """The speculation.events chunk of one verification round: no choices (like the usage
    chunk, so OpenAI clients skip it), the round in `speculation_round`."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(session_id, obj, created, model, []), "speculation_round": event}


def usage_chunk(chat: bool, session_id: str, created: int, model: str, usage: dict,
                speculation: dict) -> dict:
    """The include_usage chunk: no choices, the whole request's usage and speculation."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(session_id, obj, created, model, []), "usage": usage,
            "speculation": speculation}
