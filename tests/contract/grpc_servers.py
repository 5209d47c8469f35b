"""Real in-process servers for tests/contract/test_grpc_fuzz.py: a draft worker, a verifier,
and a verifier whose only draft worker is a scripted hostile one. They run on an event loop in
a daemon thread so hypothesis can drive them example after example through sync channels.
"""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
import uuid

import grpc
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.config import DraftConfig
from draft_service.main import build_app, build_worker
from tandem.grpc_limits import max_message_bytes
from tandem.spec import DraftResult, Method
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

VOCAB, HIDDEN, CONTEXT = 49152, 32, 256
GENERATE = "/tandem.v1.VerifyService/Generate"
SPECULATE = "/tandem.v1.DraftService/Speculate"
_SAMPLING = {"greedy": common_pb2.SamplingParams(temperature=0),
             "seeded": common_pb2.SamplingParams(temperature=1, seed=7),
             "sampled": common_pb2.SamplingParams(temperature=1)}


def save_tiny_llama(path, target_root):
    """A random two-layer Llama on the target's tokenizer, for the draft and the verifier."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked logits: greedy and seeded outputs far from ties
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_root / name, path / name)
    return path


class FeatureHead:
    """Stands in for an EAGLE head (drafts nothing): the worker's feature paths run without
    loading one."""

    method, feature_size, max_context_length = Method.EAGLE, HIDDEN, CONTEXT

    def propose(self, requests):
        return [DraftResult() for _ in requests]

    def release(self, session_key) -> None:
        pass


class HostileDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers every open and commit with `script`: proposals for this or other sessions, at
    right or wrong epochs and positions, with any q, or errors with any code."""

    script: list[dict] = []

    async def Speculate(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        async for msg in request_iterator:
            which = msg.WhichOneof("control")
            if which == "open":
                o = msg.open
                session_id, epoch, end = o.session_id, o.epoch, len(o.token_ids)
            elif which == "commit":
                c = msg.commit
                session_id, epoch, end = c.session_id, c.epoch, c.start_position + len(c.token_ids)
            else:
                continue
            for i, p in enumerate(self.script):
                yield _proposal(p, session_id, epoch, end + i)

    async def Info(self, request, context):  # noqa: N802
        return common_pb2.WorkerInfo(role=common_pb2.WORKER_ROLE_DRAFT)


def _proposal(p: dict, session_id: str, epoch: int, position: int) -> draft_pb2.DraftProposal:
    msg = draft_pb2.DraftProposal(
        session_id={"own": session_id, "other": "zz"}.get(p["session"], ""),
        epoch=epoch if p["epoch"] is None else p["epoch"],
        position=position if p["position"] is None else p["position"], token_id=p["token_id"],
        q=common_pb2.SparseDistribution(token_ids=p["q_ids"], probs=p["q_probs"]))
    if p["error"] is not None:
        msg.error.code, msg.error.message = p["error"], "scripted"
    return msg


class Servers:
    def __init__(self, model_dir):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.hostile = HostileDraft()
        self.draft_limit = max_message_bytes(CONTEXT, HIDDEN)
        self.draft, self.verifier, self.linked, self.hostile_server = self.run(
            self._start(str(model_dir)))
        self.draft_channel = grpc.insecure_channel(f"127.0.0.1:{self.draft.port}")
        self.verifier_channel = grpc.insecure_channel(f"127.0.0.1:{self.verifier.port}")
        self.linked_channel = grpc.insecure_channel(f"127.0.0.1:{self.linked.port}")
        self._references: dict[str, list[int]] = {}

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, model: str):
        cfg = DraftConfig(host="127.0.0.1", port=0, model=model, kv_cache_mb=1,
                          drain_grace_s=0.2, max_sessions=8)
        worker, info = build_worker(cfg)
        worker.proposers[Method.EAGLE] = FeatureHead()
        draft = await build_app(cfg, worker, info)
        await draft.server.start()
        hostile = grpc.aio.server()
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self.hostile, hostile)
        port = hostile.add_insecure_port("127.0.0.1:0")
        await hostile.start()
        common = dict(model=model, kv_cache_mb=2, calibrate_reps=0, medusa="off",
                      layer_skip="off", max_sessions=4)
        verifier = await start_verifier(VerifierConfig(**common))
        linked = await start_verifier(VerifierConfig(
            **common, draft_addresses=(f"127.0.0.1:{port}",), max_draft_wait_ms=5))
        return draft, verifier, linked, hostile

    def draft_idle(self, timeout: float = 5.0) -> bool:
        """Every session of the ended streams is freed."""
        deadline = time.monotonic() + timeout
        while self.draft.worker.load() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.draft.worker.load() == 0

    def linked_generate(self, mode: str, method: int) -> tuple[list[int], list[int]]:
        """Six tokens from the hostile-linked verifier, and the plain decoding's for `mode`."""
        def tokens(method: int) -> list[int]:
            req = verify_pb2.GenerateRequest(
                session_id=uuid.uuid4().hex, prompt_token_ids=[1, 2, 3, 4, 5],
                sampling=_SAMPLING[mode], stopping=verify_pb2.StoppingCriteria(
                    max_new_tokens=6, ignore_eos=True),
                speculation=verify_pb2.SpeculationConfig(method=method,
                                                         num_speculative_tokens=4))
            code, details, out = generate(self.linked_channel, req.SerializeToString())
            assert code == grpc.StatusCode.OK, details
            assert out[-1].finish_reason == verify_pb2.FINISH_REASON_LENGTH
            return [t for r in out for t in r.token_ids]

        if mode not in self._references:
            self._references[mode] = tokens(common_pb2.SPECULATION_METHOD_NONE)
        return tokens(method), self._references[mode]

    def close(self) -> None:
        for ch in (self.draft_channel, self.verifier_channel, self.linked_channel):
            ch.close()

        async def stop():
            await self.verifier.drain_and_stop(0)
            await self.linked.drain_and_stop(0)
            await self.hostile_server.stop(None)
            await self.draft.server.stop(None)
            await self.draft.worker.aclose()
        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def generate(channel: grpc.Channel, raw: bytes):
    """(code, details, responses) of Generate on raw request bytes."""
    call = channel.unary_stream(GENERATE,
                                response_deserializer=verify_pb2.GenerateResponse.FromString)
    out = []
    try:
        for resp in call(raw, timeout=60):
            out.append(resp)
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), out
    return grpc.StatusCode.OK, "", out


def speculate(channel: grpc.Channel, raws: list[bytes]):
    """(code, details, replies) of one Speculate stream sending raws, then half-closing."""
    call = channel.stream_stream(SPECULATE,
                                 response_deserializer=draft_pb2.DraftProposal.FromString)
    out = []
    try:
        for reply in call(iter(raws), timeout=60):
            out.append(reply)
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), out
    return grpc.StatusCode.OK, "", out


def healthy(channel: grpc.Channel) -> bool:
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return resp.status == health_pb2.HealthCheckResponse.SERVING
