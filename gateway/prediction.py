"""Predicted Outputs (OpenAI's `prediction`, on chat completions and, as an extension, on
completions): the text the client expects the answer to be mostly, e.g. the file a code edit
rewrites. The gateway checks its shape and length and tokenizes it; the verifier proposes it
as drafts (tandem/proposers/prediction.py), verified like any other, so the text is the same
with or without it. What it did is reported as OpenAI does, in
`usage.completion_tokens_details`:

- accepted_prediction_tokens: prediction tokens the verifier proposed and kept;
- rejected_prediction_tokens: prediction tokens it proposed (verified) and did not keep.
  Unlike OpenAI's count (every prediction token not in the completion), tokens never
  proposed (skipped by a re-alignment after an edit, or left over when the answer ended)
  are not counted: they cost nothing here.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.errors import bad_request, check_chars_fit


class PredictionPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """`prediction`: {"type": "content", "content": "..." or [{"type": "text", "text": ...}]}."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["content"]
    content: str | list[PredictionPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


async def prediction_token_ids(prediction: Prediction | None, tokenizer: Any,
                               context_length: int, max_token_chars: int = 0,
                               tokenize_in: Executor | None = None) -> tuple[int, ...]:
    """The prediction's token ids (no special tokens), tokenized off the event loop; () for
    none or an empty one. 400 naming `prediction` when it cannot fit the context, as a
    prompt: by its characters first (no tokenizing of a huge body), then by its tokens."""
    text = "" if prediction is None else prediction.text()
    if not text:
        return ()
    check_chars_fit("prediction", len(text), context_length, max_token_chars)
    ids = await asyncio.get_running_loop().run_in_executor(
        tokenize_in, lambda: tokenizer(text, add_special_tokens=False).input_ids)
    if len(ids) > context_length:
        raise bad_request(f"prediction: {len(ids)} tokens exceed the context length of "
                          f"{context_length} tokens", param="prediction",
                          code="context_length_exceeded")
    return tuple(ids)


def usage_details(counts: tuple[int, int] | None) -> dict:
    """The usage fields of a request with a prediction (`counts`: accepted, rejected);
    nothing for one without."""
    if counts is None:
        return {}
    return {"completion_tokens_details": {"accepted_prediction_tokens": counts[0],
                                          "rejected_prediction_tokens": counts[1]}}
