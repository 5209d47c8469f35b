"""Draft workers a verifier runs in its own process, over its own target: layer skip.

The verifier talks to it over loopback gRPC like to any draft worker (one draft-link code
path: epochs, run-ahead, fail-open), but the weights are the ones it already holds. This sits
in the tools layer because it joins the two services, which never import each other.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.engine.layer_skip import resolve_skip_set
from tandem.engine.llama import LlamaModel
from tandem.models import ModelPaths, tokenizer_hash
from tandem.spec import Method

log = logging.getLogger(__name__)


@dataclass
class ColocatedDrafts:
    addresses: dict[Method, str]
    app: object = field(repr=False)  # draft_service.main.DraftApp

    async def stop(self) -> None:
        await self.app.drain(0.0)


async def start_layer_skip(model: LlamaModel, paths: ModelPaths, config) -> ColocatedDrafts | None:
    """A layer-skip draft worker on a free loopback port, or None when the verifier's config
    turns it off or no skip set is known for the model (`tandem search-skip` makes one)."""
    from draft_service.config import DraftConfig
    from draft_service.limits import Limits
    from draft_service.main import build_app
    from draft_service.proposers.layer_skip import LayerSkipProposer
    from draft_service.worker import DraftWorker
    from tandem.v1 import common_pb2

    skip = resolve_skip_set(config.layer_skip, paths)
    if skip is None:
        if config.layer_skip != "off":
            log.info("no layer-skip set for %s: layer_skip is not served here", paths.root.name)
        return None
    proposer = LayerSkipProposer.over(model, skip, config.layer_skip_kv_mb << 20,
                                      config.block_size)
    draft_cfg = DraftConfig(host="127.0.0.1", port=0, max_sessions=config.max_sessions)
    limits = Limits(proposer.vocab_size, proposer.max_context_length, draft_cfg.max_sessions,
                    draft_cfg.max_run_ahead, draft_cfg.max_run_ahead_cap, draft_cfg.top_n,
                    draft_cfg.max_top_n)
    info = common_pb2.WorkerInfo(
        role=common_pb2.WORKER_ROLE_DRAFT, model_id=paths.root.name,
        tokenizer_hash=tokenizer_hash(paths), vocab_size=proposer.vocab_size,
        max_context_length=proposer.max_context_length, max_sessions=draft_cfg.max_sessions,
        max_speculative_tokens=draft_cfg.max_run_ahead_cap, max_top_n=draft_cfg.max_top_n,
        methods=[int(Method.LAYER_SKIP)])
    app = await build_app(draft_cfg, DraftWorker({Method.LAYER_SKIP: proposer}, limits), info)
    await app.server.start()
    log.info("layer skip served in-process on 127.0.0.1:%d (skipping layers %s of %d)",
             app.port, list(skip.skip), skip.num_layers)
    return ColocatedDrafts({Method.LAYER_SKIP: f"127.0.0.1:{app.port}"}, app)
