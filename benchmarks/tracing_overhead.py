"""Cost of tracing: tokens/s with OpenTelemetry on (OTLP/HTTP to a local sink) vs off.

  python benchmarks/tracing_overhead.py [--tokens 64] [--reps 6]

Two identical local clusters run side by side, one with OTEL_TRACES_EXPORTER=otlp pointed at
a local HTTP sink that accepts and discards the spans, one without tracing; requests alternate
between them (so background load hits both alike) and the median tokens/s are compared.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tandem.spec.methods import API_NAMES, Method
from tools.launcher import Cluster, ClusterConfig, free_port

PROMPT = "Write a short story about a lighthouse keeper."


class _Sink(BaseHTTPRequestHandler):
    received = 0

    def do_POST(self):  # noqa: N802 (http.server API)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received += 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def tokens_per_s(url: str, n: int, method: str) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": n, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}],
            "speculation": {"method": method}}
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--method", default=Method.DRAFT_MODEL.api_name, choices=API_NAMES)
    ap.add_argument("--out", default="results/tracing_overhead.json")
    args = ap.parse_args()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    traced_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "500",
                  "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.server_port}"}
    off = Cluster(ClusterConfig(gateway_port=free_port()), log=print, output=subprocess.DEVNULL,
                  env={"OTEL_TRACES_EXPORTER": "none"})
    on = Cluster(ClusterConfig(gateway_port=free_port()), log=print, output=subprocess.DEVNULL,
                 env=traced_env)
    try:
        off.start()
        on.start()
        tokens_per_s(off.gateway_url, 8, args.method)  # warm-up both
        tokens_per_s(on.gateway_url, 8, args.method)
        tps = {"off": [], "on": []}
        for _ in range(args.reps):
            tps["off"].append(tokens_per_s(off.gateway_url, args.tokens, args.method))
            tps["on"].append(tokens_per_s(on.gateway_url, args.tokens, args.method))
    finally:
        on.stop()
        off.stop()
        sink.shutdown()
    med = {k: statistics.median(v) for k, v in tps.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "tokens_per_s": tps, "median": med,
              "overhead": 1 - med["on"] / med["off"], "otlp_posts_received": _Sink.received}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"tokens/s median: tracing off {med['off']:.2f}, on {med['on']:.2f} "
          f"-> overhead {result['overhead'] * 100:.1f}% ({_Sink.received} OTLP exports)")


if __name__ == "__main__":
    main()
