"""Chat templates as vLLM treats them: chat only where the checkpoint has a template or
`--chat-template` gives one; otherwise /v1/chat/completions is a 400 naming the flag, and
/v1/completions serves the model as it is (a base model has no turn format to guess)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from gateway.errors import bad_request

_JINJA_CHARS = "{}\n"  # vLLM's test: a value with none of them was meant as a path


def load_chat_template(value: str | None) -> str | None:
    """--chat-template's value: a file's contents, or the template itself written inline
    (escapes such as \\n decoded), as vLLM's `load_chat_template` reads it. A value that
    looks like a path but is no readable file is an error (ValueError)."""
    if not value:
        return None
    try:
        return Path(value).expanduser().read_text()
    except (OSError, ValueError) as exc:  # ValueError: a NUL or a name too odd to be a path
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it could "
                             f"not be read: {exc}") from None
    # escapes decoded, other characters kept (latin-1 + backslashreplace round-trips all)
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def with_chat_template(tokenizer: Any, template: str | None) -> Any:
    """The tokenizer that applies `template` (a shallow copy: the caller's is left as it
    was; the copy shares its vocabulary); without one, the tokenizer itself."""
    if not template:
        return tokenizer
    chosen = copy.copy(tokenizer)
    chosen.chat_template = template
    return chosen


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer: Any) -> None:
    """A chat request for a model without a chat template: 400, naming the flag (vLLM
    refuses it too; transformers no longer guesses a default template)."""
    if not has_chat_template(tokenizer):
        raise bad_request(
            "this model has no chat template (a base model, or a checkpoint that ships "
            "none): chat completions need one. Start the server with --chat-template FILE "
            "(or an inline Jinja template), or send the text to /v1/completions",
            param="messages", code="chat_template_missing")
