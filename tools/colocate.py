"""Draft workers a verifier runs in its own process, over its own target: layer skip.

The verifier talks to it over loopback gRPC like to any draft worker (one draft-link code
path: epochs, run-ahead, fail-open), but the weights are the ones it already holds. This sits
in the tools layer because it joins the two services, which never import each other.
"""
from __future__ import annotations

import functools
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
    from draft_service.main import assemble_worker, build_app
    from tandem.grammar.compiler import LazyCompiler, compiler_for
    from tandem.models import generation_eos_ids
    from tandem.proposers.layer_skip import LayerSkipProposer

    skip = resolve_skip_set(config.layer_skip, paths)
    if skip is None:
        if config.layer_skip != "off":
            log.info("no layer-skip set for %s: layer_skip is not served here", paths.root.name)
        return None
    proposer = LayerSkipProposer.over(model, skip, config.layer_skip_kv_mb << 20,
                                      config.block_size)
    # No TLS even when the verifier has it: loopback only, and its DraftPool dials pinned
    # (in-process) workers in plaintext.
    draft_cfg = DraftConfig(host="127.0.0.1", port=0, max_sessions=config.max_sessions)
    worker, info = assemble_worker(draft_cfg, {Method.LAYER_SKIP: proposer}, paths.root.name,
                                   tokenizer_hash(paths), proposer.vocab_size,
                                   proposer.max_context_length)
    worker.grammars = LazyCompiler(functools.partial(  # it drafts under structured output too
        compiler_for, paths.root, proposer.vocab_size, generation_eos_ids(paths)))
    app = await build_app(draft_cfg, worker, info)
    await app.server.start()
    log.info("layer skip served in-process on 127.0.0.1:%d (skipping layers %s of %d)",
             app.port, list(skip.skip), skip.num_layers)
    return ColocatedDrafts({Method.LAYER_SKIP: f"127.0.0.1:{app.port}"}, app)
