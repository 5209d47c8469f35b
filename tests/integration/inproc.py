"""In-process plumbing for engine tests: a verifier Engine whose draft link goes straight
into a real DraftWorker's stream (no gRPC), so the real proposers draft for the real engine."""
import asyncio
import threading
from contextlib import contextmanager

import torch

from draft_service.limits import Limits
from draft_service.worker import DraftWorker
from kernels.sampling import logits_to_probs
from tandem.engine.block_manager import BlockManager
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.spec.cost import CostModel
from tools.bench.inproc import OnePool, WorkerLink
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams


def fails_after(proposer_cls, calls: int, message: str):
    """A subclass of proposer_cls whose propose() raises from call `calls + 1` on (the worker
    then reports INTERNAL for the sessions: fail-open tests); `.calls` counts them."""

    class Failing(proposer_cls):
        calls = 0

        def propose(self, requests):
            self.calls += 1
            if self.calls > calls:
                raise RuntimeError(message)
            return super().propose(requests)

    return Failing


def run_sessions(target_model, proposers, method, prompts, sampling, max_new, die_after=None,
                 stop=(), batch=64, medusa=None, max_spec_tokens=4, cost=None, logprobs=None,
                 rounds=None, prefill_chunk_tokens=0, tree=None, features_cached=False,
                 forwarded=None, step_cost=None, history=None, kv_window=0, block_size=16,
                 num_blocks=512, grammar=None, make_runner=None, auto_draft=None,
                 predictions=None):
    """Generate every prompt through the engine with `method`'s proposer in a DraftWorker
    (or the engine's own Medusa heads): (token lists, drafted, accepted, link). `logprobs`
    asks for them; `rounds`, a list, receives every RoundOutput per prompt; `tree` is
    GenerateParams.tree (None: trees for medusa only); features_cached: the runner keeps
    features (EAGLE then takes cache hits and chunks); `forwarded`, a list, receives the
    token count of every target forward; step_cost: the batch plan's curve (None: no plan);
    history: the engine's own HistoryDrafts (ngram / suffix drafted in its step); kv_window:
    SchedulerConfig.kv_window (KV blocks past a sliding window released as it goes);
    grammar: (GrammarSpec, GrammarCompiler): every session follows that grammar;
    make_runner(num_blocks, block_size): the target's runner (a tensor-parallel leader's);
    auto_draft: GenerateParams.auto_draft (auto also takes the worker's drafts);
    predictions: one GenerateParams.prediction per prompt (Predicted Outputs); `sampling`
    and `stop` may be lists, one per prompt (sessions with different controls, one batch)."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    stops = stop if isinstance(stop, list) else [stop] * len(prompts)

    async def main():
        runner = (make_runner(num_blocks, block_size) if make_runner is not None else
                  ModelRunner(target_model, num_blocks, block_size,
                              keep_features=features_cached))
        if forwarded is not None:
            forward = runner.forward
            runner.forward = lambda chunks, **kw: (
                forwarded.append(sum(len(c.token_ids) for c in chunks)), forward(chunks, **kw))[1]
        sched = Scheduler(BlockManager(num_blocks, block_size), SchedulerConfig(
            max_spec_tokens=max_spec_tokens, max_num_seqs=batch, features_cached=features_cached,
            prefill_chunk_tokens=prefill_chunk_tokens, kv_window=kv_window),
            cost or CostModel(),
            tree_reach=medusa.cfg.reach if medusa is not None else (),
            chain_reach=medusa.cfg.chain_reach if medusa is not None else (),
            step_cost=step_cost)
        # A generous wait bound: the head's first draft of a session (the whole prompt to
        # read) is slower than the 25 ms default, and these sessions only have two rounds.
        engine = Engine(Executor(runner, medusa), sched,
                        EngineConfig(max_sessions=4096, max_draft_wait_ms=500),
                        target_model.cfg.vocab_size, history=history)
        worker = DraftWorker(proposers,
                             Limits(target_model.cfg.vocab_size, 8192, max_sessions=4096))
        link = WorkerLink(engine, worker, die_after)
        engine.drafts.pool = OnePool(link)
        loop = asyncio.create_task(engine.run())
        queues = [engine.submit(GenerateParams(
            session_id=f"s{i}", prompt=tuple(p), committed=(),
            sampling=samplings[i],
            max_new_tokens=max_new, stop_token_ids=frozenset(stops[i]), method=method,
            logprobs=logprobs, tree=tree, grammar=grammar and grammar[0],
            auto_draft=auto_draft, prediction=tuple(predictions[i]) if predictions else ()),
            grammar and grammar[1].state_now(grammar[0]))
            for i, p in enumerate(prompts)]
        results, drafted, accepted = [], 0, 0
        for q in queues:
            tokens, last, outs = [], None, []
            while last is None or last.finish_reason is None:
                last = await asyncio.wait_for(q.get(), 120)
                tokens += last.token_ids
                outs.append(last)
            if rounds is not None:
                rounds.append(outs)
            results.append(tokens)
            drafted, accepted = drafted + last.drafted_total, accepted + last.accepted_total
        loop.cancel()
        await worker.aclose()
        return results, drafted, accepted, link

    return asyncio.run(main())


def target_joint_top2(target_model, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The target's joint probability of its first two tokens at T=1, top-k 2 (4 outcomes)."""
    runner = ModelRunner(target_model, 8, 16)

    def dist(seq):
        logits = runner.forward([SeqChunk(seq, 0, list(range(4)))])
        return logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([2]),
                               torch.tensor([1.0]))[0]

    p1, joint = dist(prompt), {}
    for a in p1.topk(2).indices.tolist():
        pa = dist(prompt + [a])
        for b in pa.topk(2).indices.tolist():
            joint[(a, b)] = p1[a].item() * pa[b].item()
    return joint


class FixedCost(CostModel):
    """A cost model that keeps its prices: the rounds' measured times are not learnt, so what
    a test's sessions draft does not depend on how loaded the host is (a learnt curve of real
    times made a draft model's drafts stop paying under a busy CI)."""

    def observe(self, num_tokens: int, elapsed_ms: float) -> None:
        pass


def dear_verify() -> CostModel:
    """A cost model on which every draft pays: a verify priced at 1 s whatever its size, kept
    (FixedCost), so neither a draft's reach nor the wait for it prices it out (for tests of
    what drafts do, not of whether they pay)."""
    return FixedCost({q: 1000.0 for q in range(1, 80)})


@contextmanager
def gateway_cluster(draft_config, verifier_config, model, tokenizer, model_name: str,
                    setup=None):
    """A real draft worker and verifier (gRPC on loopback, on an event loop in a thread),
    Redis and the gateway app: yields a TestClient. `verifier_config(draft_port)` gives the
    verifier's config once the draft worker's port is known; `setup(verifier)`, if given, runs
    on the verifier's loop once it is up."""
    import redis.asyncio as aioredis
    from fastapi.testclient import TestClient

    from draft_service.main import build_app
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from tandem.redis_server import start_redis
    from verify_service.main import start_verifier

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    async def servers():
        draft = await build_app(draft_config)
        await draft.server.start()
        verifier = await start_verifier(verifier_config(draft.port), model=model)
        if setup is not None:
            setup(verifier)
        return draft, verifier

    draft, verifier = run(servers())
    try:
        with start_redis() as redis_proc:
            config = GatewayConfig(redis_url=redis_proc.url, model_name=model_name,
                                   static_verifiers=(f"127.0.0.1:{verifier.port}",),
                                   static_drafts=(f"127.0.0.1:{draft.port}",))
            app = create_app(config, redis=aioredis.Redis.from_url(redis_proc.url),
                             tokenizer=tokenizer)
            with TestClient(app) as client:
                yield client
    finally:
        run(verifier.drain_and_stop(0))
        run(draft.drain(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
