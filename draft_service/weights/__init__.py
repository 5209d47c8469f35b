"""Draft checkpoints shipped inside the package.

smollm2-135m-draft/ is the default draft for SmolLM2-135M-Instruct, produced by
`tandem distill` (the exact command line, data, training time and measured acceptance are in
its tandem_draft.json). It is a HF-format Llama directory with a truncated vocabulary
(draft_vocab.json maps draft rows to target ids; tandem.engine.llama.LlamaModel applies it).
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT_NAME = "smollm2-135m-draft"


def default_draft_dir() -> Path:
    """The shipped default draft for the default target (SmolLM2-135M-Instruct)."""
    return Path(__file__).resolve().parent / DEFAULT_DRAFT_NAME
