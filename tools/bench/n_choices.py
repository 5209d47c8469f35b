"""n=4 in one request vs four n=1 requests sent together (same prompt, T=0.8, 64 tokens
each, ignore_eos so every choice does the same work); alternating, wall time each, and the
verifier's CPU seconds read from /proc with --vpid. Results: docs/results/n_choices.md.

    flock /tmp/tandem-bench.lock .venv/bin/python -m tools.bench.n_choices \
        http://127.0.0.1:8130/v1/chat/completions 3 --fresh --vpid=PID   # PARAS=48: long
"""
import asyncio
import json
import os
import sys
import time

import httpx

from tools.bench import proc_cpu

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8130/v1/chat/completions"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
REPEAT_PARA = int(os.environ.get("PARAS", "12"))
PARA = ("The river runs past the old mill, where the miller keeps his accounts in a ledger "
        "bound in green leather, and every evening he counts the sacks of flour twice. ")
BODY = {"model": "SmolLM2-135M-Instruct", "temperature": 0.8, "max_tokens": 64,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": PARA * REPEAT_PARA + "Summarise the story."}]}


FRESH = "--fresh" in sys.argv  # a new prompt each measurement: prefill is paid each time
NONCE = [0]


async def one(client, nonce=None, **extra):
    body = {**BODY, **extra}
    if nonce is not None:
        body["messages"] = [{"role": "user", "content": f"Story {nonce}. " + PARA * REPEAT_PARA
                             + "Summarise the story."}]
    r = await client.post(URL, json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def nonce():
    NONCE[0] += 1
    return NONCE[0] if FRESH else None


async def n4(client):
    t = time.perf_counter()
    out = await one(client, nonce(), n=4)
    return time.perf_counter() - t, out["usage"], len(out["choices"])


async def four(client):
    t = time.perf_counter()
    k = nonce()
    outs = await asyncio.gather(*(one(client, k) for _ in range(4)))
    usage = {"prompt_tokens": sum(o["usage"]["prompt_tokens"] for o in outs),
             "completion_tokens": sum(o["usage"]["completion_tokens"] for o in outs)}
    return time.perf_counter() - t, usage, len(outs)


VPID = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--vpid=")), None)


def cpu_s() -> float:
    """The verifier's CPU seconds so far (user + system), 0 without --vpid."""
    return 0.0 if VPID is None else proc_cpu.cpu_s(int(VPID))


async def main():
    async with httpx.AsyncClient() as client:
        await one(client, max_tokens=4)  # warm-up: load, compile, cache
        rows = []
        for rep in range(REPS):
            for name, fn in (("n=4", n4), ("4 x n=1", four)):
                cpu = cpu_s()
                wall, usage, k = await fn(client)
                cpu = cpu_s() - cpu
                rows.append((rep, name, wall, cpu))
                print(json.dumps({"rep": rep, "mode": name, "wall_s": round(wall, 3),
                                  "verifier_cpu_s": round(cpu, 2), "choices": k,
                                  "usage": usage}), flush=True)
        for name in ("n=4", "4 x n=1"):
            walls = sorted(w for _, m, w, _ in rows if m == name)
            cpus = sorted(c for _, m, _, c in rows if m == name)
            print(f"{name}: wall median {walls[len(walls) // 2]:.3f} s all "
                  f"{[round(w, 3) for w in walls]}; verifier CPU median "
                  f"{cpus[len(cpus) // 2]:.2f} s all {[round(c, 2) for c in cpus]}")

if __name__ == "__main__":
    asyncio.run(main())
