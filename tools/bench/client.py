"""Talking to a running Tandem: the gateway as a user would (streaming chat completions), and
the verifier's gRPC Generate directly for what the gateway does not forward (per-round stats).
"""
from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import httpx

from tandem.spec.methods import Method
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from tools.bench.sse import CHAT_PATH, achunks, choice_text
from tools.bench.stats import decode_tps, itl_samples

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 600.0


def chat_body(prompt: str, tokens: int, temperature: float, method: str, k: int,
              seed: int | None = None, shape: str | None = None,
              ignore_eos: bool = True) -> dict:
    """A streamed chat completion of exactly `tokens` tokens (ignore_eos: every method does the
    same work, and EOS does not end a run early in one method and not in another; False: at
    most `tokens`). `shape`: "chain" or "tree" for medusa and eagle; None leaves it to the
    verifier's default."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": temperature, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"method": method, "num_speculative_tokens": k}}
    if shape is not None:
        body["speculation"]["draft_shape"] = shape
    if seed is not None:  # seeded rounds accept drafts that match the keyed samples
        body["seed"] = seed
    return body


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed request: TTFT, decode tokens/s, the chunks' arrival times and text, and
    the gateway's `speculation` stats."""
    start = time.perf_counter()
    times, texts, final = [], [], {}
    async with client.stream("POST", url + CHAT_PATH, json=body, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]}")
        async for obj in achunks(r.aiter_lines()):
            if "error" in obj:
                raise RuntimeError(f"gateway stream error: {obj['error']}")
            content = "".join(choice_text(c) for c in obj.get("choices", []))
            if content:
                times.append(time.perf_counter())
                texts.append(content)
            if obj.get("usage"):
                final = obj
    n = final.get("usage", {}).get("completion_tokens", 0)
    first = times[0] if times else time.perf_counter()
    return {"tokens": n, "ttft_s": first - start, "e2e_s": time.perf_counter() - start,
            "decode_tps": decode_tps(n, first, times[-1] if times else first),
            "speculation": final.get("speculation", {}), "chunk_times": times,
            "chunk_texts": texts}


def run_single(url: str, body: dict) -> dict:
    async def go():
        async with httpx.AsyncClient() as client:
            return await stream_chat(client, url, body)

    out = asyncio.run(go())
    out.pop("chunk_texts")
    out.pop("chunk_times")
    return out


def run_concurrent(url: str, bodies: list[dict], tokenizer) -> dict:
    """All bodies at once; total tokens/s over the wall time and per-token ITL percentiles
    (a chunk's token count is re-tokenized from its text: the SSE stream carries text only)."""
    async def go():
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(limits=limits) as client:
            start = time.perf_counter()
            outs = await asyncio.gather(*(stream_chat(client, url, b) for b in bodies))
            return outs, time.perf_counter() - start

    outs, wall = asyncio.run(go())
    itl, ttft = [], []
    for o in outs:
        counts = [len(tokenizer.encode(t, add_special_tokens=False)) for t in o["chunk_texts"]]
        itl += itl_samples(o["chunk_times"], counts)
        ttft.append(o["ttft_s"])
    tokens = sum(o["tokens"] for o in outs)
    return {"sessions": len(bodies), "tokens": tokens, "wall_s": wall,
            "total_tps": tokens / wall, "itl_s": itl, "ttft_s": ttft,
            "session_decode_tps": [o["decode_tps"] for o in outs]}


def verifier_rounds(address: str, prompt_ids: list[int], tokens: int, temperature: float,
                    method: str, k: int, seed: int | None = None,
                    draft_address: str = "") -> dict:
    """One session straight on the verifier: each message is one round, with its own timings.
    Rows are stats.RoundRow tuples; the gap is measured here, at the client."""
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=0, top_p=1.0)
    if seed is not None:
        sampling.seed = seed
    req = verify_pb2.GenerateRequest(
        session_id=f"bench-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
        sampling=sampling,
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
        speculation=verify_pb2.SpeculationConfig(method=int(Method.parse(method)),
                                                 num_speculative_tokens=k,
                                                 draft_address=draft_address))
    rows, n = [], 0
    with grpc.insecure_channel(address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        start = prev = time.perf_counter()
        first = None
        for resp in stub.Generate(req, timeout=TIMEOUT_S):
            now = time.perf_counter()
            r = resp.round
            gap = None if first is None else (now - prev) * 1e3
            if resp.token_ids:
                rows.append((r.drafted, r.accepted, r.bonus, r.draft_wait_ms, r.verify_ms,
                             r.rejection_ms, gap, len(resp.token_ids)))
                first = first or now
                prev, n = now, n + len(resp.token_ids)
    return {"tokens": n, "ttft_s": (first or start) - start,
            "decode_tps": decode_tps(n, first or start, prev), "rounds": rows}


def worker_addresses(redis_url: str, password: str = "") -> dict[str, list[str]]:
    """Live verifier and draft addresses from the cluster's registry in Redis (`password`:
    the launcher's own Redis's, else $REDIS_PASSWORD)."""
    from tandem import redis_conn
    from tandem.envflags import env
    from tandem.registry import WorkerRegistry

    async def go():
        client = redis_conn.client(redis_url, password or env(redis_conn.PASSWORD_ENV, ""))
        try:
            reg = WorkerRegistry(client)
            return {role: [w.address for w in await reg.list(role)]
                    for role in ("verifier", "draft")}
        finally:
            await client.aclose()

    return asyncio.run(go())
