"""Draft workers a verifier hosts in its own process, over its own target: layer skip.

The verifier's draft side talks to it through the same messages as to any draft worker (one
draft-link code path: epochs, run-ahead, fail-open), handed straight to the worker and back:
no socket, no protobuf, no gRPC. Its drafting runs on the worker's own thread, beside the
verifier's forward, as a remote worker's would. This sits in the tools layer because it joins
the two services, which never import each other.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

from draft_service.tracing import SessionSpans
from tandem.engine.layer_skip import resolve_skip_set
from tandem.engine.llama import LlamaModel
from tandem.models import ModelPaths, tokenizer_hash
from tandem.spec import Control, Method

log = logging.getLogger(__name__)


class HostedLink:
    """One stream to a worker in this process: controls go into the worker as they are sent,
    its proposals come back as it makes them; it ends when the worker ends the stream."""

    def __init__(self, worker, method: Method, on_message, on_broken):
        self.address = f"in-process:{method.api_name}"
        self.alive = True
        self.worker = worker
        self.stream = worker.open_stream()
        self._spans = SessionSpans()  # the draft side's spans, as the gRPC servicer makes
        self._pump = asyncio.get_running_loop().create_task(self._run(on_message, on_broken))

    def send(self, control: Control) -> None:
        if self.alive:
            self._spans.control(control)
            self.worker.handle(self.stream, control)

    async def _run(self, on_message, on_broken) -> None:
        try:
            while (item := await self.stream.get()) is not None:
                self._spans.reply(item)
                on_message(self, item)
        finally:
            self.alive = False
            self._spans.end_all()
            self.worker.close_stream(self.stream)
            on_broken(self)

    async def close(self) -> None:
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)


@dataclass
class WorkerHost:
    """A draft worker in this process, for the verifier's draft side (verify_service.drafts.
    side.Host): one live link at a time, a new one after the last ended."""

    worker: object = field(repr=False)  # draft_service.worker.DraftWorker
    method: Method
    _link: HostedLink | None = None

    def link(self, on_message, on_broken) -> HostedLink:
        if self._link is None or not self._link.alive:
            self._link = HostedLink(self.worker, self.method, on_message, on_broken)
        return self._link

    async def stop(self) -> None:
        if self._link is not None:
            await self._link.close()
        await self.worker.aclose()


@dataclass
class ColocatedDrafts:
    hosts: dict[Method, WorkerHost]

    async def stop(self) -> None:
        for host in self.hosts.values():
            await host.stop()


async def start_layer_skip(model: LlamaModel, paths: ModelPaths, config) -> ColocatedDrafts | None:
    """A layer-skip draft worker in this process, or None when the verifier's config turns it
    off or no skip set is known for the model (`tandem search-skip` makes one)."""
    from draft_service.config import DraftConfig
    from draft_service.main import assemble_worker
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
    draft_cfg = DraftConfig(max_sessions=config.max_sessions)
    worker, _ = assemble_worker(draft_cfg, {Method.LAYER_SKIP: proposer}, paths.root.name,
                                tokenizer_hash(paths), proposer.vocab_size,
                                proposer.max_context_length)
    worker.grammars = LazyCompiler(functools.partial(  # it drafts under structured output too
        compiler_for, paths.root, proposer.vocab_size, generation_eos_ids(paths)))
    log.info("layer skip hosted in-process (skipping layers %s of %d)",
             list(skip.skip), skip.num_layers)
    return ColocatedDrafts({Method.LAYER_SKIP: WorkerHost(worker, Method.LAYER_SKIP)})
