"""The target's hidden states at the positions a round keeps, for the heads that draft from
them: EAGLE features, sent to the draft worker with the commit, and the Medusa heads' next
drafts, proposed here in the verifier from the last kept position."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tandem.engine.eagle3 import parse_feature_layers
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelError
from tandem.spec import DraftRequest, Features, Proposer, propose_isolated
from verify_service.forward.step import RoundOutcome, StepInput


def feature_layers(spec: str, model, medusa) -> tuple[int, ...]:
    """The runner's feature_layers for --eagle-feature-layers `spec` (ModelError for layers
    the target does not have); Medusa heads, which read the final hidden state, refuse any
    other features."""
    layers = parse_feature_layers(spec, model.cfg.num_layers)
    if layers and medusa is not None:
        raise ModelError(f"Medusa heads read the final hidden state, which "
                         f"--eagle-feature-layers {spec} replaces: pass --medusa off or "
                         "--eagle-feature-layers final")
    return layers


def kept_rows(s: StepInput, path: list[int] | None) -> slice | list[int]:
    """The input's rows whose KV the round keeps: the committed part (the root included),
    then the accepted path; a slice where they are consecutive (a chain's: a view, no copy)."""
    before = len(s.token_ids) - len(s.drafts)  # rows of the committed part (root incl.)
    path = path or []
    if path == list(range(len(path))):
        return slice(0, before + len(path))
    return list(range(before)) + [before + j for j in path]


def kept_hidden(s: StepInput, path: list[int] | None, hidden: torch.Tensor | np.ndarray | None,
                at: int) -> torch.Tensor | np.ndarray | None:
    """[kept, hidden] final hidden states of the positions whose KV the round keeps (kept_rows),
    of the step's tensor or of its float16 copy (as_float16). None when the forward returned no
    hidden states or this input ran no forward; `at` is its first row there."""
    if hidden is None or not s.token_ids:
        return None
    return hidden[at:at + len(s.token_ids)][kept_rows(s, path)]


def as_float16(hidden: torch.Tensor) -> np.ndarray:  # [rows, width] -> the same, float16
    """A step's hidden states in the features' wire type, converted once for every session
    (a conversion and a copy per session cost ~10 us each: ~0.4 ms a step at 32 sessions)."""
    return hidden.to(torch.float16).cpu().numpy()


def eagle_features(runner: ModelRunner, s: StepInput, path: list[int] | None,
                   hidden16: np.ndarray, at: int) -> Features:
    """The kept positions' hidden states for the draft (`hidden16`: the step's, as_float16; `at`:
    this input's first row there): a prompt's whole, its cached prefix and earlier chunks too,
    read back from the runner's kept features (which the forward just wrote this chunk's rows
    to)."""
    if s.prefill and s.start_pos:
        h = runner.features_at(s.block_table, 0, s.start_pos + len(s.token_ids))
        return Features(0, h.shape[1], h.cpu().numpy().tobytes())
    h = kept_hidden(s, path, hidden16, at)
    return Features(s.start_pos, h.shape[1], h.tobytes())


def propose_trees(proposer: Proposer, inputs: list[StepInput], outcomes: list[RoundOutcome],
                  heads: list[tuple[int, torch.Tensor]]) -> None:
    """The next round's drafts (a tree, or a chain of the heads' top-1 tokens) of every
    session in `heads` (its index, its last kept [hidden] state), from one call of the
    proposer hosted in the step (Medusa's heads), set on its outcome in place. A session the
    proposer fails for simply gets no drafts."""
    requests = [DraftRequest(session_key=i, token_ids=[], num_committed=0,
                             max_tokens=inputs[i].propose_tree, features=h[None],
                             tree=not inputs[i].propose_chain) for i, h in heads]
    for (i, _), res in zip(heads, propose_isolated(proposer, requests)):
        if res.error is None:
            outcomes[i] = replace(outcomes[i], tree=(res.tokens, res.parents))
