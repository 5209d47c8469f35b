"""Reaches inside: a profile hook sees the files a round calls only with both services in-process.

Which project files (and how many of their lines) one speculation round runs through.

Starts a draft worker (the shipped draft model) and a verifier in this process, streams one
greedy draft_model session, and records every project file whose code is called during a few
steady-state rounds (after warm-up), on every thread. Prints the files with their line counts
and the totals. The gateway's per-round work (relaying a GenerateResponse) is not included.

    python benchmarks/round_path.py [--rounds 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "tandem", "verify_service", "draft_service", "gateway")


class Recorder:
    """A profile hook on every thread that notes the project files called while recording."""

    def __init__(self):
        self.recording = False
        self.files: set[str] = set()

    def hook(self, frame, event, arg):
        if self.recording and event == "call":
            self.files.add(frame.f_code.co_filename)

    def install(self):
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)

    def project_files(self) -> dict[str, int]:
        out = {}
        for name in self.files:
            path = Path(name).resolve()
            try:
                rel = path.relative_to(ROOT)
            except ValueError:
                continue
            if rel.parts[0] in PACKAGES and "_pb2" not in rel.name:
                out[str(rel)] = len(path.read_text().splitlines())
        return dict(sorted(out.items()))


async def _draft_server():
    from draft_service.config import DraftConfig
    from draft_service.weights import default_draft_dir

    try:
        from draft_service.main import build_app
    except ImportError:  # the layout before the restructure
        from draft_service.server import build_app
    app = await build_app(DraftConfig(port=0, model=str(default_draft_dir())))
    await app.server.start()
    return app


async def run(rounds: int, rec: Recorder) -> None:
    from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
    from verify_service.config import VerifierConfig
    from verify_service.main import start_verifier

    draft = await _draft_server()
    verifier = await start_verifier(VerifierConfig(
        kv_cache_mb=64, draft_addresses=(f"127.0.0.1:{draft.port}",)))
    req = verify_pb2.GenerateRequest(
        session_id="path", prompt_token_ids=list(range(100, 140)),
        sampling=common_pb2.SamplingParams(temperature=0),
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=200),
        speculation=verify_pb2.SpeculationConfig(
            method=common_pb2.SPECULATION_METHOD_DRAFT_MODEL, num_speculative_tokens=3))
    seen = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as ch:
        async for resp in verify_pb2_grpc.VerifyServiceStub(ch).Generate(req, timeout=300):
            seen += 1
            rec.recording = 5 <= seen < 5 + rounds  # skip the prefill and warm-up rounds
            if seen >= 5 + rounds or resp.finish_reason:
                break
    rec.recording = False
    await verifier.drain_and_stop(0)
    await draft.server.stop(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="steady-state rounds recorded")
    ap.add_argument("--json", help="also write the file list here")
    args = ap.parse_args()
    rec = Recorder()
    rec.install()
    asyncio.run(run(args.rounds, rec))
    files = rec.project_files()
    for name, lines in files.items():
        print(f"{lines:6d}  {name}")
    print(f"{sum(files.values()):6d}  lines in {len(files)} files")
    if args.json:
        Path(args.json).write_text(json.dumps(files, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
