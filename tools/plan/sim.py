"""The whole deployment on a SimPy clock: traffic, the gateway's routing, the verifiers and
the draft pool; `simulate(cfg, profile, acceptance)` returns plan.json's figures."""
from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import simpy

from tools.bench.stats import percentile
from tools.plan import drafts as dp
from tools.plan.acceptance import DEFAULTS, MethodAcceptance
from tools.plan.config import LINKED_METHODS, Request, SimConfig
from tools.plan.gateway import SharedLoop
from tools.plan.profile import Profile
from tools.plan.session import SimSession
from tools.plan.verifier import SimVerifier

_VOCAB = 49_152  # prompt token ids are drawn below this; generated ones count up from it


@dataclass
class SimStats:
    steps: int = 0
    busy_ms: float = 0.0  # verifier forward time, all verifiers
    preemptions: int = 0
    waiting_sum: int = 0  # sessions queued for admission, summed over verifier steps
    kv_usage_sum: float = 0.0  # KV cache fraction in use, summed over verifier steps


def load_trace(path: str) -> list[Request]:
    """JSON lines: {"t": seconds from the start, "prompt_tokens", "max_tokens",
    "conversation" (optional)}."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(Request(float(row["t"]) * 1e3, int(row["prompt_tokens"]),
                               int(row["max_tokens"]), str(row.get("conversation", ""))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{i + 1}: a trace line needs t, prompt_tokens and "
                             f"max_tokens ({exc})") from None
    if not out:
        raise ValueError(f"{path}: the trace is empty")
    return sorted(out, key=lambda r: r.arrival_ms)


def make_requests(cfg: SimConfig, rng: random.Random) -> list[Request]:
    """The traffic: the trace, or N requests of the configured lengths (Poisson arrivals at
    --rate; arrival 0 under --concurrency, where the clients pace them)."""
    if cfg.trace:
        return load_trace(cfg.trace)
    t, out, fixed = 0.0, [], cfg.prompt_lengths
    for i in range(cfg.requests):
        if cfg.rate:
            t += rng.expovariate(cfg.rate) * 1e3
        out.append(Request(t, fixed[i % len(fixed)], cfg.max_tokens, prompt_id=i % len(fixed))
                   if fixed else Request(t, cfg.prompt_tokens, cfg.max_tokens))
    return out


class Deployment:
    """Gateway, verifiers and draft pool: routes each request as the gateway does (the
    verifier of its conversation when it has one, else the least loaded) and a draft worker
    (least loaded)."""

    def __init__(self, env, cfg: SimConfig, profile: Profile, acc: MethodAcceptance, seed: int):
        self.env, self.cfg, self.profile = env, cfg, profile
        self.rng = random.Random(seed)
        self.ids = itertools.count(_VOCAB)
        self.stats = SimStats()
        self.verifiers = [SimVerifier(env, cfg, profile, acc, random.Random(seed + i + 1),
                                      self.ids, self.stats) for i in range(cfg.verifiers)]
        linked = cfg.method in LINKED_METHODS
        self.workers = [dp.DraftWorker(env, profile, self.ids)
                        for _ in range(cfg.drafts if linked else 0)]
        if profile.colocated_draft and self.workers:  # worker i on verifier i's device
            for i, w in enumerate(self.workers):
                self.verifiers[i % len(self.verifiers)].colocated.append(w)
        self.loop = SharedLoop(env)  # the gateway's admissions
        self.affinity: dict[str, SimVerifier] = {}
        self.shared = tuple(self.rng.randrange(_VOCAB) for _ in range(cfg.shared_prefix_tokens))
        self.sessions: list[SimSession] = []
        if cfg.warm_prefixes:
            for v in self.verifiers:
                for i, n in enumerate(cfg.prompt_lengths):
                    blocks, prompt = v.scheduler.blocks, self.prompt(Request(0, n, 1, prompt_id=i))
                    blocks.allocate("warm", prompt)
                    blocks.commit("warm", len(prompt))
                    blocks.free("warm")

    def prompt(self, req: Request) -> tuple[int, ...]:
        """The request's prompt ids: the shared prefix, then its own (one per prompt id)."""
        rng = self.rng if req.prompt_id < 0 else random.Random(f"{self.cfg.seed}/{req.prompt_id}")
        return self.shared + tuple(rng.randrange(_VOCAB)
                                   for _ in range(req.prompt_tokens - len(self.shared)))

    def submit(self, req: Request, hold_ms: float = 0.0):
        """A SimPy process: the request through the gateway to a verifier, until it ends;
        hold_ms: its first bytes' extra delay (Profile.reuse_hold_ms)."""
        n = len(self.sessions)
        sess = SimSession(f"s{n}", req, self.prompt(req), self.env.now,
                          gateway_ms=self.profile.gateway_ms / 2, hold_ms=hold_ms,
                          finished=self.env.event())
        self.sessions.append(sess)
        yield self.loop.admit(self.profile.gateway_ms / 2)  # shared with concurrent ones
        yield self.env.timeout(self.profile.hop_ms())
        v = self.affinity.get(req.conversation) or min(self.verifiers, key=lambda x: x.load)
        if req.conversation:
            self.affinity[req.conversation] = v
        v.submit(sess)
        if self.workers:
            sess.lane = dp.DraftLane(want=self.cfg.k_cap + 1,
                                     ready_ms=self.env.now + self.profile.hop_ms())
            min(self.workers, key=lambda w: w.load).attach(sess.seq, sess.lane)
        yield sess.finished


def _drive(env, dep: Deployment, cfg: SimConfig, requests: list[Request], progress):
    """Arrivals: clients in a closed loop (concurrency) or at the requests' own times. A
    closed-loop client sends each request after its first on the connection its last one
    just finished on (the hold)."""
    if cfg.concurrency:
        queue = iter(requests)

        def client():
            hold = 0.0
            for req in queue:
                yield env.process(dep.submit(req, hold))
                hold = dep.profile.reuse_hold_ms
                progress()
        return [env.process(client()) for _ in range(cfg.concurrency)]

    def one(req):
        yield env.timeout(req.arrival_ms)
        yield env.process(dep.submit(req))
        progress()
    return [env.process(one(r)) for r in requests]


def simulate(cfg: SimConfig, profile: Profile, acc: MethodAcceptance | None = None,
             progress=None) -> dict:
    """Run the deployment under its traffic to the end; plan.json's figures."""
    acc = acc or DEFAULTS[cfg.method]
    env = simpy.Environment()
    dep = Deployment(env, cfg, profile, acc, cfg.seed)
    requests = make_requests(cfg, random.Random(cfg.seed))
    t0 = time.perf_counter()
    procs = _drive(env, dep, cfg, requests, progress or (lambda: None))
    env.run(until=simpy.AllOf(env, procs))
    wall = time.perf_counter() - t0
    return summarize(cfg, profile, acc, dep, env.now, wall)


def summarize(cfg: SimConfig, profile: Profile, acc: MethodAcceptance, dep: Deployment,
              end_ms: float, wall_s: float) -> dict:
    ss = dep.sessions
    start = min(s.arrival_ms for s in ss)
    tokens = sum(s.tokens for s in ss)
    ttft = [s.ttft_ms for s in ss]
    tpot = [s.tpot_ms for s in ss if s.tpot_ms is not None] or [0.0]
    rounds = sum(s.rounds for s in ss)
    ks: dict[int, int] = {}
    for s in ss:
        for k, n in s.ks.items():
            ks[k] = ks.get(k, 0) + n
    span_s = max(1e-9, (max(s.last_ms for s in ss) - start) / 1e3)
    return {
        "throughput_tok_s": tokens / span_s,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "acceptance_length_mean": tokens / rounds if rounds else 0.0,
        "requests": len(ss), "output_tokens": tokens, "simulated_s": span_s,
        "rounds": rounds, "k_histogram": dict(sorted(ks.items())),
        "drafted_tokens": sum(s.drafted for s in ss),
        "accepted_tokens": sum(s.accepted for s in ss),
        "preemptions": dep.stats.preemptions, "verifier_steps": dep.stats.steps,
        "verifier_utilization": dep.stats.busy_ms / (span_s * 1e3 * cfg.verifiers),
        "waiting_sessions_mean": dep.stats.waiting_sum / max(1, dep.stats.steps),
        "kv_cache_usage_mean": dep.stats.kv_usage_sum / max(1, dep.stats.steps),
        "draft_batch_mean": (sum(w.batch_sum for w in dep.workers)
                             / max(1, sum(w.steps for w in dep.workers))),
        "wall_s": wall_s, "requests_per_wall_s": len(ss) / max(wall_s, 1e-9),
        "profile": {"name": profile.name, "source": profile.source},
        "acceptance": {"position_rates": list(acc.position_rates),
                       "propose_rate": acc.propose_rate, "rounds": acc.rounds},
        "config": cfg.__dict__,
        "label": "simulation",
    }
