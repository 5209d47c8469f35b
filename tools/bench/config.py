"""What one `tandem bench` run measures: the methods each phase runs, BenchConfig and its
--quick variant, the prompt set, and the models (draft, EAGLE head) the run resolves to.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tandem.device import check_device_spec, check_dtype_spec
from tandem.spec.methods import API_NAMES, Method
from tools.bench.shapes import TREE_METHODS

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
# Every method the API names but mtp: the default target carries no MTP module, so an mtp row
# would be plain decoding under another name.
TANDEM_METHODS = tuple(m for m in API_NAMES if m != Method.MTP.api_name)
SPEC_METHODS = tuple(m for m in TANDEM_METHODS if m != Method.NONE.api_name)  # those that draft
# Direct verifier runs: plain too, so the gateway hop of plain decoding is measured as well.
ROUND_METHODS = (Method.NONE.api_name, *SPEC_METHODS)
QUICK_CONCURRENCY_METHODS = (Method.NONE.api_name, Method.NGRAM.api_name,
                             Method.DRAFT_MODEL.api_name)


# Every prompt is asked several times in a run (per temperature, then direct): with its
# cross-request cache on, suffix would draft from the run's own earlier answers. The standard
# run measures it on prompts it has not seen; `--workload repetitive` measures the cache.
SUFFIX_CACHE_OFF = {"TANDEM_DRAFT_SUFFIX_CACHE_TOKENS": "0",
                    "TANDEM_VERIFIER_SUFFIX_CACHE_TOKENS": "0"}  # auto and suffix draft there


@dataclass(frozen=True)
class BenchConfig:
    max_tokens: int = 128
    k: int = 16  # draft tokens per round at most, for every method (the verifier's cap)
    temperatures: tuple[float, ...] = (0.0, 0.7)  # Tandem through the gateway
    peer_temperatures: tuple[float, ...] = (0.0, 0.7)  # the transformers peers
    round_temperatures: tuple[float, ...] = (0.0, 0.7)  # direct gRPC runs for round stats
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    # Every level runs each of these, interleaved (for each level, for each method).
    concurrency_methods: tuple[str, ...] = TANDEM_METHODS
    # The chain-vs-tree phase (tools.bench.shapes) runs these methods, greedy, on the first
    # shape_prompts prompts of the run (0 = all of them); () skips the phase.
    shape_methods: tuple[str, ...] = TREE_METHODS
    shape_prompts: int = 0
    per_category: int = 0  # prompts per category, 0 = all
    prompt_ids: tuple[str, ...] = ()  # only these prompts (smoke runs); () = no filter
    model: str = ""  # target; "" = the default
    draft_model: str = ""  # "" = the shipped draft
    eagle: str = ""  # EAGLE head directory; "" = the shipped head ("none": no eagle)
    threads: int = 1  # torch threads per worker process
    peer_threads: int = 1  # torch threads of the transformers peers (1 is as fast as 2 here)
    peers: bool = True
    # None: Tandem requests carry no seed, as most users send them. Seeded sampled sessions
    # verify by matching keyed samples instead of rejection sampling: pass one to measure that.
    seed: int | None = None
    quick: bool = False
    # Where every model of the run goes (tandem.device): the peers and cost timings in this
    # process, and the cluster's verifier and draft worker (passed on as --device / --dtype).
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self):
        if (self.max_tokens < 2 or not 1 <= self.k <= 32 or self.per_category < 0
                or self.shape_prompts < 0):
            raise ValueError("need max_tokens >= 2, 1 <= k <= 32, per_category >= 0, "
                             "shape_prompts >= 0")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        bad = [m for m in self.concurrency_methods if m not in API_NAMES]
        if bad or not self.concurrency_methods:
            raise ValueError(f"concurrency methods must be some of {', '.join(API_NAMES)}; "
                             f"got {','.join(bad) or 'an empty list'}")
        bad = [m for m in self.shape_methods if m not in TREE_METHODS]
        if bad:
            raise ValueError(f"shape methods must be some of {', '.join(TREE_METHODS)}; "
                             f"got {','.join(bad)}")
        check_device_spec(self.device)
        check_dtype_spec(self.dtype)


def quick_config(**overrides) -> BenchConfig:
    """--quick: one prompt per category, 64 tokens, greedy-only peers and round stats,
    concurrency 1/4/8 for none, ngram and draft_model, chain vs tree on 3 prompts: about
    five minutes on the 2-core machine."""
    base = dict(max_tokens=64, peer_temperatures=(0.0,), round_temperatures=(0.0,),
                concurrency=(1, 4, 8), per_category=1, quick=True,
                concurrency_methods=QUICK_CONCURRENCY_METHODS, shape_prompts=3)
    return BenchConfig(**{**base, **overrides})


def load_prompts(per_category: int = 0, ids: tuple[str, ...] = (),
                 path: Path = PROMPTS_FILE) -> list[dict]:
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if ids:
        rows = [r for r in rows if r["id"] in ids]
    if not per_category:
        return rows
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if seen[r["category"]] <= per_category:
            out.append(r)
    return out


def resolve_eagle(value: str) -> str:
    """The EAGLE head the cluster serves: a directory, or "" for none."""
    if value.strip().lower() == "none":
        return ""
    if value:
        return value
    from draft_service.weights import default_eagle_dir

    shipped = default_eagle_dir()
    return str(shipped) if (shipped / "config.json").is_file() else ""


def resolve_draft(draft_model: str, out_dir: Path) -> tuple[str, dict]:
    """The draft directory every phase loads, and what to say about it. The shipped draft is
    copied first: a distillation may swap a new checkpoint in mid-run, and the peers and the
    cluster must measure the same weights."""
    if draft_model:
        return draft_model, {"source": draft_model}
    from draft_service.weights import default_draft_dir

    shipped = Path(default_draft_dir())
    if not (shipped / "config.json").is_file():
        raise SystemExit(f"no shipped draft at {shipped}; pass --draft-model DIR")
    snap = out_dir / "draft-snapshot"
    shutil.rmtree(snap, ignore_errors=True)
    shutil.copytree(shipped, snap)
    info = {"source": str(shipped), "snapshot": str(snap)}
    try:
        card = json.loads((snap / "tandem_draft.json").read_text())
        info.update(architecture=card.get("architecture"), progress=card.get("progress"))
    except (OSError, ValueError):
        pass
    return str(snap), info
