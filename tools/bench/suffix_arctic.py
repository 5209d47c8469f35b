"""Suffix decoding: Tandem's (tandem/proposers/suffix.py) against ArcticInference's
(`arctic-inference`, the method's authors) on the same traces.

Traces are the real target's greedy text (SmolLM2-135M-Instruct through `LocalGenerator`) on the
copy-heavy prompts (tools/bench/copy_prompts.py) and the chat/story/grounded prompts
(tools/bench/prompts.jsonl), cached in a JSON file. Each arm replays them in order, twice (the
second pass: the same questions asked again, the cross-request cache warm): every round it
proposes up to k tokens for the committed text, the longest prefix equal to the trace is
accepted and one more token committed (greedy verification), as the verifier does. Each arm runs
in its own process (Arctic's in the scratch venv it was installed into) so its memory is its
own: resident memory after the replay minus before it, with both caches still held.

  flock /tmp/tandem-bench.lock .venv/bin/python -m tools.bench.suffix_arctic \
      --arctic-python /tmp/arctic/bin/python [--tokens 256] [--k 16] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TRACES = Path("/tmp/tandem-suffix-traces.json")


def make_traces(path: Path, tokens: int) -> list[dict]:
    """The target's greedy continuations of every prompt, cached in path."""
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached and cached[0].get("max_tokens") == tokens:
            return cached
    from transformers import AutoTokenizer

    from tandem.engine.generate import LocalGenerator
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import ModelRunner
    from tandem.models import generation_eos_ids, resolve_model
    from tandem.sampling_params import SamplingParams
    from tools.bench.copy_prompts import TASKS

    root = Path(__file__).resolve().parents[2]
    prompts = [(f"copy-{i}", cat, p) for i, (cat, p) in enumerate(TASKS)]
    for line in (root / "tools/bench/prompts.jsonl").read_text().splitlines():
        rec = json.loads(line)
        prompts.append((rec["id"], rec["category"], rec["prompt"]))
    paths = resolve_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    model = LlamaModel.load(paths)
    eos = tuple(generation_eos_ids(paths)) or (tok.eos_token_id,)
    out = []
    for i in range(0, len(prompts), 8):  # 8 at a time: the KV cache stays small
        batch = prompts[i:i + 8]
        ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
               for _, _, p in batch]
        gen = LocalGenerator(ModelRunner(model, 8 * (1024 // 16), 16)).generate(
            ids, SamplingParams(temperature=0.0), tokens, eos)
        out += [{"id": pid, "category": cat, "prompt": p, "output": g, "max_tokens": tokens}
                for (pid, cat, _), p, g in zip(batch, ids, gen)]
        print(f"traces: {len(out)} of {len(prompts)}", file=sys.stderr, flush=True)
    path.write_text(json.dumps(out))
    return out


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def tandem_arm(k: int):
    """Tandem's SuffixProposer with its defaults: propose(committed), release + learn."""
    from tandem.proposers.suffix import SuffixProposer
    from tandem.spec import DraftRequest

    prop = SuffixProposer(max_spec_tokens=k)

    def start(key, prompt):
        return None

    def propose(key, committed):
        req = DraftRequest(session_key=key, token_ids=committed, num_committed=len(committed),
                           max_tokens=k)
        return [t.token_id for t in prop.propose([req])[0].tokens]

    def commit(key, new):
        return None  # the proposer indexes committed tokens on its next propose

    def stop(key, full):
        prop.release(key)
        prop.learn("", full)

    return start, propose, commit, stop


def arctic_arm(k: int, depth: int = 24):
    """ArcticInference's SuffixDecodingCache with vLLM's `suffix` defaults (tree depth 24,
    spec factor 1.0, offset 0, min token prob 0.1, 10000 cached requests), chain drafts."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)

    def start(key, prompt):
        cache.start_request(key, prompt)

    def propose(key, committed):
        draft = cache.speculate(key, committed[-depth:], max_spec_tokens=k, max_spec_factor=1.0,
                                max_spec_offset=0.0, min_token_prob=0.1, use_tree_spec=False)
        return list(draft.token_ids)

    def commit(key, new):
        cache.add_active_response(key, new)

    def stop(key, full):
        cache.stop_request(key)

    return start, propose, commit, stop


def replay(arm: str, traces: list[dict], k: int, passes: int, depth: int = 24) -> dict:
    """Every trace in order, `passes` times; per pass: rounds, drafted, accepted, and the
    seconds spent in the arm (proposing and taking in committed tokens)."""
    start, propose, commit, stop = tandem_arm(k) if arm == "tandem" else arctic_arm(k, depth)
    before = rss_kib()  # modules imported, the proposer built: what its state adds is counted
    result = {"arm": arm, "passes": []}
    for p in range(passes):
        stats = dict(tokens=0, rounds=0, drafted=0, accepted=0, seconds=0.0, calls=0)
        for tr in traces:
            key, prompt, out = f"{tr['id']}#{p}", tr["prompt"], tr["output"]
            t0 = time.perf_counter()
            start(key, prompt)
            stats["seconds"] += time.perf_counter() - t0
            i = 0
            while i < len(out):
                committed = prompt + out[:i]
                t0 = time.perf_counter()
                draft = propose(key, committed)
                stats["seconds"] += time.perf_counter() - t0
                n = 0
                while n < len(draft) and i + n < len(out) and draft[n] == out[i + n]:
                    n += 1
                new = out[i:i + n + 1]  # the accepted drafts and the target's own token
                t0 = time.perf_counter()
                commit(key, new)
                stats["seconds"] += time.perf_counter() - t0
                stats["rounds"] += 1
                stats["calls"] += 1
                stats["drafted"] += len(draft)
                stats["accepted"] += n
                i += len(new)
            t0 = time.perf_counter()
            stop(key, prompt + out)
            stats["seconds"] += time.perf_counter() - t0
            stats["tokens"] += len(out)
        result["passes"].append(stats)
    result["rss_kib"] = rss_kib() - before
    return result


def run_arm(python: str, arm: str, traces: Path, k: int, passes: int, depth: int) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--arm", arm, "--traces", str(traces),
           "--k", str(k), "--passes", str(passes), "--arctic-depth", str(depth)]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, check=False,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin",
                               "HOME": str(Path.home()), "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{arm} arm failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def report(results: list[dict], k: int) -> None:
    print(f"| arm | pass | tokens | rounds | mean accepted / round | tokens / round | "
          f"acceptance | drafting µs / token | resident memory |  (k <= {k})")
    for r in results:
        for p, s in enumerate(r["passes"]):
            print(f"| {r['arm']} | {p + 1} | {s['tokens']} | {s['rounds']} | "
                  f"{s['accepted'] / s['rounds']:.2f} | {s['tokens'] / s['rounds']:.2f} | "
                  f"{s['accepted'] / max(1, s['drafted']):.2f} | "
                  f"{1e6 * s['seconds'] / s['tokens']:.1f} | {r['rss_kib'] / 1024:.1f} MiB |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("tandem", "arctic"), help="(worker) replay one arm")
    ap.add_argument("--traces", default=str(TRACES))
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per trace")
    ap.add_argument("--k", type=int, default=16, help="most drafts a round (Tandem's cap)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="runs of each arm (best time kept)")
    ap.add_argument("--arctic-python", default="/tmp/arctic/bin/python")
    ap.add_argument("--arctic-depth", type=int, default=24,
                    help="Arctic's max_tree_depth (vLLM's default 24; the library's 64)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.arm:  # worker: one arm in this process
        traces = json.loads(Path(args.traces).read_text())
        print(json.dumps(replay(args.arm, traces, args.k, args.passes, args.arctic_depth)))
        return 0
    traces = make_traces(Path(args.traces), args.tokens)
    print(f"{len(traces)} traces, {sum(len(t['output']) for t in traces)} tokens",
          file=sys.stderr)
    results = []
    for arm, python in (("tandem", sys.executable), ("arctic", args.arctic_python)):
        runs = [run_arm(python, arm, Path(args.traces), args.k, args.passes, args.arctic_depth)
                for _ in range(args.reps)]
        best = min(runs, key=lambda r: sum(p["seconds"] for p in r["passes"]))
        best["rss_kib"] = sorted(r["rss_kib"] for r in runs)[len(runs) // 2]  # median
        results.append(best)
    report(results, args.k)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
