"""`tandem plan calibrate`: this host's costs as a profile. The verify curve by tokens comes
from the verifier's own start-up calibration (verify_service.policy.calibration.calibrate:
one session, q new tokens after 64 cached) extended to prefill sizes; the batch dimension
from steps of b sessions x 1 token; the draft step by batch from the draft model's runner
(the shipped draft unless --draft-model); the hop from a loopback TCP round trip."""
from __future__ import annotations

import statistics
import time

from tools.plan.profile import Profile

VERIFY_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 17, 32, 64, 128, 256)  # tokens per forward
BATCHES = (1, 2, 4, 8, 16, 32)  # sessions x 1 token


def _runner(model: str, kv_mb: int, threads: int, draft: bool):
    import torch

    from tandem.device import place
    from tandem.engine.exact_dtype import load_target
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import ModelRunner
    from tandem.models import resolve_model

    if threads:
        torch.set_num_threads(threads)
    at = place("cpu", "auto")
    if draft:  # as a draft worker loads it (float32 on the cpu)
        from draft_service.cli import resolve_model_flag
        path = resolve_model_flag(model or None)
        if path is None:
            raise ValueError("no draft model given and none shipped")
        lm = LlamaModel.load(resolve_model(path), "float32")
    else:
        lm = load_target(resolve_model(model or None), at)
    return ModelRunner.with_memory(lm, kv_mb << 20, at.block_size)


def batch_curve(runner, batches=BATCHES, context: int = 64, reps: int = 3) -> dict[int, float]:
    """Median ms of one step of b sessions, one new token each after `context` cached."""
    from tandem.engine.model_runner import SeqChunk

    bs = runner.block_size
    per = -(-(context + 1) // bs)
    if per * max(batches) > runner.num_blocks:
        return {}
    ids = [(37 * i) % 1000 + 100 for i in range(context + 1)]
    for b in range(max(batches)):  # fill every session's context once
        runner.forward([SeqChunk(ids[:context], 0, list(range(b * per, (b + 1) * per)))])
    out = {}
    for b in batches:
        times = []
        for _ in range(reps + 1):
            chunks = [SeqChunk(ids[context:], context, list(range(i * per, (i + 1) * per)))
                      for i in range(b)]
            t0 = time.perf_counter()
            runner.forward(chunks)
            times.append((time.perf_counter() - t0) * 1e3)
        out[b] = statistics.median(times[1:])
    return out


def hop_ms(samples: int = 200) -> float:
    """Half the median round trip of a unary gRPC call over loopback (the health check: a
    tiny message through the same stack the draft link uses), in ms."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            rtts = []
            for _ in range(samples):
                t0 = time.perf_counter()
                stub.Check(health_pb2.HealthCheckRequest())
                rtts.append((time.perf_counter() - t0) * 1e3)
    finally:
        server.stop(0)
    return statistics.median(rtts[10:]) / 2


def calibrate_host(model: str = "", draft_model: str = "", threads: int = 1, reps: int = 3,
                   name: str = "cpu-host") -> Profile:
    from verify_service.policy.calibration import calibrate

    target = _runner(model, 256, threads, draft=False)
    verify = calibrate(target, VERIFY_COUNTS, reps=reps)
    batch = batch_curve(target, reps=reps)
    del target
    draft = batch_curve(_runner(draft_model, 128, threads, draft=True), reps=reps)
    # what b sessions cost beyond one session's forward over b tokens
    from tools.plan.profile import interpolate
    extra = {b: max(0.0, ms - interpolate(verify, b)) for b, ms in batch.items()}
    return Profile(
        name=name, source=f"measured on this host by `tandem plan calibrate` "
        f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {threads} torch thread(s))",
        verify_ms=verify, draft_ms=draft or {1: 5.0}, seq_overhead_ms=0.0,
        batch_extra_ms=extra or {1: 0.0}, batch_ms=batch,
        net_latency_ms=round(hop_ms(), 4), step_overhead_ms=0.0,
        notes=f"batch steps (b sessions x 1 token, ms): {batch}")
