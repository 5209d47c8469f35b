"""Which token ids a draft worker's drafts are in: what its Info advertises, and the
checkpoint whose tokenizer names them (structured output compiles grammars with it)."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from draft_service.config import DraftConfig
from tandem.models import ModelError, ModelPaths, default_target_dir, resolve_model, tokenizer_hash

log = logging.getLogger(__name__)


def bridge_target(config: DraftConfig) -> ModelPaths | None:
    """The target whose ids a draft model of another tokenizer drafts in (proposers/
    bridged.py): --tokenizer's checkpoint when its tokenizer.json differs from the draft
    model's; None when the draft model's ids are the target's (or there is no draft model)."""
    if config.model is None or not config.tokenizer:
        return None
    target = ModelPaths(Path(config.tokenizer))
    if tokenizer_hash(target) == tokenizer_hash(resolve_model(config.model)):
        return None
    return target


def token_space(config: DraftConfig, proposer) -> tuple[str, str, int]:
    """(model_id, tokenizer_hash, vocab_size) that Info advertises; `proposer`: the draft
    model (or the layer-skip target) when the worker has one."""
    if proposer is not None:  # a draft model, else the layer-skip target
        paths = resolve_model(config.model if config.model is not None else config.layer_skip)
        target = bridge_target(config)  # a bridged draft pairs with its target's verifiers
        tok_hash = tokenizer_hash(paths if target is None else target)
        return paths.root.name, tok_hash, proposer.vocab_size
    if config.eagle is not None and not config.tokenizer:  # the head ships its tokenizer
        root = Path(config.eagle)
        with contextlib.suppress(OSError, ValueError, KeyError, ModelError):
            vocab = json.loads((root / "draft_vocab.json").read_text())["target_vocab_size"]
            return root.name, tokenizer_hash(ModelPaths(root)), int(vocab)
    if config.mtp is not None and not config.tokenizer:  # MTP lives in the target checkpoint
        with contextlib.suppress(OSError, ValueError, KeyError, ModelError):
            root = resolve_model(config.mtp).root
            vocab = json.loads((root / "config.json").read_text())["vocab_size"]
            return root.name, tokenizer_hash(ModelPaths(root)), int(vocab)
    root = Path(config.tokenizer) if config.tokenizer else default_target_dir()
    try:  # n-gram lookup works on any ids: the tokenizer only names them for pairing
        cfg = json.loads((root / "config.json").read_text())
        return "ngram", tokenizer_hash(ModelPaths(root)), int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, ModelError) as exc:
        if config.tokenizer:
            raise ModelError(f"cannot read the tokenizer checkpoint {root}: {exc}") from exc
        log.warning("no tokenizer known (%s): Info advertises no tokenizer hash", exc)
        return "ngram", "", 2**31 - 1


def tokenizer_root(config: DraftConfig) -> Path:
    """The checkpoint directory that names the drafts' token ids."""
    target = bridge_target(config)
    if target is not None:
        return target.root
    for name in (config.model, config.layer_skip):
        if name is not None:
            return resolve_model(name).root
    if config.tokenizer:
        return Path(config.tokenizer)
    if config.eagle is not None and (Path(config.eagle) / "tokenizer.json").is_file():
        return Path(config.eagle)
    if config.mtp is not None:
        return resolve_model(config.mtp).root
    return default_target_dir()
