"""Draft checkpoints shipped inside the package.

smollm2-135m-draft/ is the default draft for SmolLM2-135M-Instruct, produced by
`tandem distill` (the exact command line, data, training time and measured acceptance are in
its tandem_draft.json). It is a HF-format Llama directory with a truncated vocabulary
(draft_vocab.json maps draft rows to target ids; tandem.engine.llama.LlamaModel applies it).
smollm2-135m-eagle/ is an EAGLE head for the same target (`tandem distill --method eagle`):
one decoder layer drafting from the target's own hidden states (tandem.engine.eagle).
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT_NAME = "smollm2-135m-draft"
DEFAULT_EAGLE_NAME = "smollm2-135m-eagle"


def default_draft_dir() -> Path:
    """The shipped default draft for the default target (SmolLM2-135M-Instruct)."""
    return Path(__file__).resolve().parent / DEFAULT_DRAFT_NAME


def default_eagle_dir() -> Path:
    """The shipped EAGLE head for the default target (tandem_eagle.json says how it was
    trained and what it measured)."""
    return Path(__file__).resolve().parent / DEFAULT_EAGLE_NAME
