"""The target's hidden states at the positions a round keeps, for the heads that draft from
them: EAGLE features, sent to the draft worker with the commit, and the Medusa heads' next
drafts, proposed here in the verifier from the last kept position."""
from __future__ import annotations

from dataclasses import replace

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


def kept_hidden(s: StepInput, path: list[int] | None, hidden: torch.Tensor | None,
                at: int) -> torch.Tensor | None:
    """[kept, hidden] final hidden states of the positions whose KV the round keeps: the
    committed part (the root included), then the accepted path. None when the forward
    returned no hidden states or this input ran no forward; `at` is its first row there."""
    if hidden is None or not s.token_ids:
        return None
    before = len(s.token_ids) - len(s.drafts)  # rows of the committed part (root incl.)
    rows = list(range(before)) + [before + j for j in (path or [])]
    return hidden[at:at + len(s.token_ids)][rows]


def eagle_features(runner: ModelRunner, s: StepInput, h: torch.Tensor) -> Features:
    """The kept positions' hidden states for the draft: a prompt's whole, its cached
    prefix and earlier chunks too, read back from the runner's kept features (which the
    forward just wrote this chunk's rows to)."""
    start, h = s.start_pos, h.to(torch.float16)
    if s.prefill and start:
        h = runner.features_at(s.block_table, 0, start + len(s.token_ids))
        start = 0
    return Features(start, h.shape[1], h.cpu().numpy().tobytes())


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
