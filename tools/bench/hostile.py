"""One hostile tenant beside a quiet one, through a running gateway (issue 47's check).

The neighbour streams plain chat requests one after another: first alone (its quiet
baseline), then while the hostile tenant sends many distinct wide JSON schemas, a regex that
breaks llguidance mid-generation and a 3 MiB body. Reported: the neighbour's latency
percentiles in both phases, every hostile request's status and time, the peak RSS of the
processes named, and whether any of them exited.

    python -m tools.bench.hostile --url http://127.0.0.1:8000 --pid gateway=123 --pid verifier=456
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from tools.bench.stats import percentile

POISON_REGEX = "([a-z ]{1,50}){1,50}"  # past llguidance's limits after 2-3 tokens


@dataclass
class HostileConfig:
    url: str
    model: str = "SmolLM2-135M-Instruct"
    neighbour_requests: int = 8  # per phase
    neighbour_tokens: int = 16
    schemas: int = 12  # distinct wide schemas
    schema_properties: int = 1500
    body_mib: float = 3.0
    pids: dict[str, int] = field(default_factory=dict)


def wide_schema(n: int, salt: int) -> dict:
    """`n` optional properties, each with a pattern of its own: tens of KB of schema."""
    return {"type": "object", "properties": {
        f"k{salt}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}{salt}x{i}$"}
        for i in range(n)}}


def _chat(cfg: HostileConfig, content: str, **kw) -> dict:
    return {"model": cfg.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0, **kw}


def _neighbour(cfg: HostileConfig, client: httpx.Client, n: int) -> list[float]:
    """Wall seconds of `n` streamed plain requests, one after another."""
    times = []
    for i in range(n):
        body = _chat(cfg, f"Count from {i} to {i + 5}.", stream=True,
                     max_tokens=cfg.neighbour_tokens, speculation={"method": "none"})
        start = time.perf_counter()
        with client.stream("POST", cfg.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"neighbour request failed: {r.status_code}")
            for _ in r.iter_lines():
                pass
        times.append(time.perf_counter() - start)
    return times


def _hostile_requests(cfg: HostileConfig) -> list[tuple[str, dict | bytes]]:
    reqs: list[tuple[str, dict | bytes]] = [
        (f"schema-{i}", _chat(cfg, "Fill it.", response_format={"type": "json_schema",
         "json_schema": {"name": f"s{i}", "schema": wide_schema(cfg.schema_properties, i)}}))
        for i in range(cfg.schemas)]
    reqs.append(("poison-regex", _chat(cfg, "Write words.", max_tokens=64,
                                       guided_regex=POISON_REGEX)))
    big = "lorem ipsum " * int(cfg.body_mib * (1 << 20) / 12)
    reqs.append(("body-3MiB", json.dumps(_chat(cfg, big)).encode()))
    return reqs


def _send(cfg: HostileConfig, client: httpx.Client, name: str, body) -> dict:
    start = time.perf_counter()
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    try:
        r = client.post(cfg.url + "/v1/chat/completions", **kw)
        status = r.status_code
    except httpx.HTTPError as exc:
        status = f"{type(exc).__name__}"
    return {"name": name, "status": status, "seconds": round(time.perf_counter() - start, 2)}


class _RssWatch(threading.Thread):
    """Peak VmRSS (MiB) of each pid, sampled every 0.2 s, and whether it exited."""

    def __init__(self, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.pids, self.peak = pids, {name: 0.0 for name in pids}
        self.exited: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for name, pid in self.pids.items():
                mib = _rss_mib(pid)
                if mib is None:
                    self.exited.add(name)
                else:
                    self.peak[name] = max(self.peak[name], mib)
            self.done.wait(0.2)


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_hostile(cfg: HostileConfig) -> dict:
    watch = _RssWatch(cfg.pids)
    watch.start()
    with httpx.Client(timeout=300) as client:
        quiet = _neighbour(cfg, client, cfg.neighbour_requests)
        with cf.ThreadPoolExecutor(4) as pool:
            hostile = [pool.submit(_send, cfg, client, name, body)
                       for name, body in _hostile_requests(cfg)]
            loud = _neighbour(cfg, client, cfg.neighbour_requests)
            answers = [f.result() for f in hostile]
    watch.done.set()
    watch.join()
    return {
        "neighbour_quiet_s": _summary(quiet), "neighbour_hostile_s": _summary(loud),
        "p99_ratio": round(percentile(loud, 99) / percentile(quiet, 99), 2),
        "hostile": answers, "peak_rss_mib": {k: round(v) for k, v in watch.peak.items()},
        "exited": sorted(watch.exited)}


def _summary(times: list[float]) -> dict:
    return {"n": len(times), "p50": round(percentile(times, 50), 3),
            "p99": round(percentile(times, 99), 3), "max": round(max(times), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.hostile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the gateway's base URL")
    p.add_argument("--pid", action="append", default=[], metavar="NAME=PID",
                   help="a process whose RSS to watch (repeatable)")
    p.add_argument("--schemas", type=int, default=12, help="distinct wide schemas sent")
    p.add_argument("--neighbour-requests", type=int, default=8, help="per phase")
    args = p.parse_args(argv)
    try:
        pids = {k: int(v) for k, v in (s.split("=", 1) for s in args.pid)}
    except ValueError:
        p.error("--pid takes NAME=PID")
    out = run_hostile(HostileConfig(args.url, schemas=args.schemas, pids=pids,
                                    neighbour_requests=args.neighbour_requests))
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
