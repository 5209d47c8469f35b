"""A minimal speculation loop on the verifier's real Executor, for gpu-check: one session, no
scheduler, no gRPC (the stock GPU image has neither Redis nor OpenTelemetry for the services).

Each round feeds [last committed token, *drafts] to verify_service.forward.executor.Executor, which
runs the target forward, the rejection sampler (or greedy matching, or tree walks) and the
Medusa heads, exactly as in the server. Drafts come from a Proposer (n-gram, a draft model,
an EAGLE head fed the features the rounds return) or from the Medusa heads' trees.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.engine.model_runner import ModelRunner
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, DraftToken
from verify_service.forward.executor import Executor
from verify_service.forward.step import RoundOutcome, StepInput


@dataclass
class Run:
    """What one generation produced."""

    tokens: list[int]  # the new tokens
    drafted: int = 0
    accepted: int = 0
    logprobs: list[float] = field(default_factory=list)  # of each emitted token, if asked


@dataclass
class _State:
    committed: list[int]
    drafts: list[DraftToken] = field(default_factory=list)
    parents: tuple[int, ...] | None = None
    features: torch.Tensor | None = None  # [rows, hidden] float16, EAGLE's


def generate(runner: ModelRunner, prompt: list[int], max_new: int, sampling: SamplingParams,
             proposer=None, medusa=None, k: int = 4, logprobs: bool = False,
             graphs: bool = False) -> Run:
    """Generate max_new tokens after `prompt`: plainly (no proposer, no medusa), with a
    proposer's chains, or with Medusa trees of k nodes; `graphs`: decode steps through a
    GraphDecoder (captured on a GPU), as `--cuda-graphs on` serves them. The runner's cache
    is the session's (blocks 0.. in order; the last is the graphs' scratch)."""
    decoder = None
    if graphs:
        from tandem.engine.cuda_graphs import GraphDecoder

        decoder = GraphDecoder(runner, scratch_block=runner.num_blocks - 1)
    executor = Executor(runner, medusa, decoder)
    table = list(range(runner.num_blocks - graphs))
    if (len(prompt) + max_new + k + 1) > len(table) * runner.block_size:
        raise ValueError("the runner's cache is too small for this generation")
    want_features = proposer is not None and getattr(proposer, "method", None) is not None \
        and proposer.method.name == "EAGLE"
    st, run = _State(list(prompt)), Run([])
    first = True
    while len(run.tokens) < max_new:
        if proposer is not None and not first:
            _draft(proposer, st, k, sampling)
        start = 0 if first else len(st.committed) - 1
        ids = st.committed if first else [st.committed[-1], *(d.token_id for d in st.drafts)]
        out = _round(executor, StepInput(
            token_ids=list(ids), start_pos=start, block_table=table, drafts=list(st.drafts),
            sampling=sampling, parents=st.parents, want_features=want_features,
            propose_tree=k if medusa is not None else 0, logprobs=0 if logprobs else None,
            prefill=first))
        first = False
        run.drafted += len(st.drafts)
        run.accepted += len(out.accepted)
        new = [*out.accepted, out.next_token]
        st.committed += new
        run.tokens += new
        run.logprobs += [lp.logprob for lp in out.logprobs]
        if out.features is not None:
            _keep_features(st, out, runner.device)
        st.drafts, st.parents = (list(out.tree[0]), out.tree[1]) if out.tree else ([], None)
    if proposer is not None:
        proposer.release("gpu-check")
    run.tokens, run.logprobs = run.tokens[:max_new], run.logprobs[:max_new]
    return run


def _round(executor: Executor, step: StepInput) -> RoundOutcome:
    (outcome,), _ = executor.execute([step])
    if outcome.next_token is None:  # carried rows are the engine's business; not asked here
        raise RuntimeError("a round emitted no token")
    return outcome


def _draft(proposer, st: _State, k: int, sampling: SamplingParams) -> None:
    """Up to k chain drafts, asking again while the proposer gives one at a time."""
    st.drafts, st.parents = [], None
    while len(st.drafts) < k:
        req = DraftRequest(session_key="gpu-check", token_ids=st.committed + [d.token_id for d in
                                                                       st.drafts],
                           num_committed=len(st.committed), max_tokens=k - len(st.drafts),
                           sampling=sampling, features=st.features)
        (res,) = proposer.propose([req])
        if res.error is not None or not res.tokens:
            return
        st.drafts += res.tokens[:k - len(st.drafts)]


def _keep_features(st: _State, out: RoundOutcome, device) -> None:
    f = out.features
    rows = torch.from_numpy(np.frombuffer(f.data, dtype=np.float16).copy()).view(
        -1, f.hidden_size).to(device)
    have = st.features if st.features is not None else rows[:0]
    st.features = torch.cat([have[:f.start_position], rows])
