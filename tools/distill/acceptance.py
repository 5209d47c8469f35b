"""How often the target accepts a draft's tokens, and what a draft forward costs.

Simulation: along a path the target itself generates (greedy, or sampled at the temperature),
a round starts at EVERY position: the draft proposes k tokens from the true prefix, the target
scores them in one k+1-token forward and the real lossless rule (kernels.rejection) decides how
many are accepted. Per-position rates and the mean accepted length for any k' <= k follow from
the distribution of accepted counts, because whether draft i is accepted never depends on
drafts after it.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.attention import default_block_size
from kernels.rejection import rejection_sample
from kernels.sampling import logits_to_probs, make_generator, sample
from tandem.device import Placement, place, synchronize
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelError, resolve_model, tokenizer_hash

HELDOUT_PROMPTS = Path(__file__).resolve().parents[2] / "draft_service" / "data" / \
    "heldout_prompts.jsonl"


@dataclass(frozen=True)
class AcceptanceConfig:
    k: int = 8
    max_new_tokens: int = 96
    temperatures: tuple[float, ...] = (0.0, 0.7)
    seed: int = 0
    timing_threads: int = 1  # a draft worker and a batch-1 verifier each keep one core busy
    timing_reps: int = 40
    max_prompt_tokens: int = 256

    def __post_init__(self):
        if not 1 <= self.k <= 16 or self.max_new_tokens < 1 or self.timing_reps < 1:
            raise ValueError("need 1 <= k <= 16, max_new_tokens >= 1, timing_reps >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")


def per_position_rates(num_accepted: list[int], k: int) -> list[float]:
    """rate_i = P(draft i accepted | drafts 1..i-1 accepted), i = 1..k."""
    rates, reached = [], len(num_accepted)
    for i in range(1, k + 1):
        hit = sum(n >= i for n in num_accepted)
        rates.append(hit / reached if reached else 0.0)
        reached = hit
    return rates


def mean_accepted(rates: list[float], k: int) -> float:
    """E[min(N, k)] = sum_{i<=k} P(N >= i), with P(N >= i) the product of the first i rates."""
    total, survive = 0.0, 1.0
    for r in rates[:k]:
        survive *= r
        total += survive
    return total


def speedup(rates: list[float], k: int, c: float) -> float:
    """Leviathan et al.: tokens per round / cost of a round in target forwards (k drafts at c
    each plus one target forward; the k+1-token verify is counted as one plain forward)."""
    return (1 + mean_accepted(rates, k)) / (1 + k * c)


def load_prompts(path: Path | None) -> list[str]:
    path = path or HELDOUT_PROMPTS
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
        return [json.loads(ln)["prompt"] for ln in lines]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read prompts from {path}: {exc}") from exc


class SlotRunner:
    """A ModelRunner with a fixed, private slice of blocks per sequence (no sharing needed).
    block_size 0 = the model's device's (kernels.attention.default_block_size: 16 on the cpu)."""

    def __init__(self, model: LlamaModel, num_seqs: int, max_len: int, block_size: int = 0):
        block_size = block_size or default_block_size(model.device)
        self.per_seq = -(-max_len // block_size)
        self.runner = ModelRunner(model, num_seqs * self.per_seq, block_size)

    def table(self, i: int) -> list[int]:
        return list(range(i * self.per_seq, (i + 1) * self.per_seq))

    def forward(self, rows: list[tuple[int, list[int], int, int]]) -> torch.Tensor:
        """rows: (seq index, token ids, start position, num logits)."""
        return self.runner.forward([SeqChunk(ids, pos, self.table(i), n)
                                    for i, ids, pos, n in rows])


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    n = logits.shape[0]
    return logits_to_probs(logits, torch.full((n,), temperature), torch.zeros(n, dtype=torch.long),
                           torch.ones(n))


def _draft_round(draft: SlotRunner, paths: dict[int, list[int]], k: int, temperature: float, gen):
    """k draft tokens per active sequence from its true prefix; returns ids [B, k] and the
    dense q rows [B * k, V] (None when greedy)."""
    order = list(paths)
    tokens = {i: [paths[i][-1]] for i in order}
    qs = []
    for j in range(k):
        logits = draft.forward([(i, [tokens[i][-1]], len(paths[i]) - 1 + j, 1) for i in order])
        probs = _probs(logits, temperature)
        ids = logits.argmax(-1) if temperature == 0 else sample(probs, [gen] * len(order))
        qs.append(probs)
        for i, t in zip(order, ids.tolist()):
            tokens[i].append(t)
    drafted = torch.tensor([tokens[i][1:] for i in order])
    q = None if temperature == 0 else torch.stack(qs, 1).reshape(len(order) * k, -1)
    return drafted, q


def simulate(draft_model, target_model, prompts: list[list[int]], temperature: float,
             cfg: AcceptanceConfig, stop: tuple[int, ...]) -> list[int]:
    """Accepted-draft counts (0..k) of rounds started at every position of target paths."""
    k, max_len = cfg.k, max(map(len, prompts)) + cfg.max_new_tokens + cfg.k + 1
    draft = SlotRunner(draft_model, len(prompts), max_len)
    target = SlotRunner(target_model, len(prompts), max_len)
    # Prefill everything but the last prompt token, which each round feeds itself.
    for i, p in enumerate(prompts):
        if len(p) > 1:
            draft.forward([(i, p[:-1], 0, 0)])
            target.forward([(i, p[:-1], 0, 0)])
    paths = {i: list(p) for i, p in enumerate(prompts)}
    made = dict.fromkeys(paths, 0)
    gen = make_generator(cfg.seed)
    counts: list[int] = []
    while paths:
        order = list(paths)
        drafted, q = _draft_round(draft, paths, k, temperature, gen)
        logits = target.forward([(i, [paths[i][-1], *drafted[r].tolist()], len(paths[i]) - 1,
                                  k + 1) for r, i in enumerate(order)])
        p = _probs(logits, temperature)
        out = rejection_sample(drafted.reshape(-1), torch.arange(0, (len(order) + 1) * k, k),
                               p, q, torch.full((len(order),), temperature == 0),
                               [gen] * len(order) if temperature else None)
        counts.extend(out.num_accepted.tolist())
        # Advance each path by one token the target itself picks (row 0: the true next-token
        # distribution), so the path is the target's own greedy or sampled text.
        row0 = p[torch.arange(len(order), device=p.device) * (k + 1)]
        nxt = row0.argmax(-1) if temperature == 0 else sample(row0, [gen] * len(order))
        for i, t in zip(order, nxt.tolist()):
            paths[i].append(t)
            made[i] += 1
            if t in stop or made[i] >= cfg.max_new_tokens:
                del paths[i]
    return counts


def forward_cost_ms(model: LlamaModel, reps: int, prefix: int = 128) -> float:
    """Median batch-1, 1-token forward on a cached prefix, through ModelRunner (ms); on a GPU
    each forward is waited for (tandem.device.synchronize) before the clock is read."""
    runner, vocab = SlotRunner(model, 1, prefix + 2), model.cfg.vocab_size
    runner.forward([(0, [((7 * j) % 1000 + 100) % vocab for j in range(prefix)], 0, 1)])
    times = []
    for _ in range(reps):
        synchronize(model.device)
        start = time.perf_counter()
        runner.forward([(0, [42 % vocab], prefix, 1)])
        synchronize(model.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure_cost(draft_model, target_model, cfg: AcceptanceConfig) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.timing_threads)
    try:
        # Interleaved rounds, so a noisy neighbour slows both alike.
        d, t = [], []
        for _ in range(3):
            d.append(forward_cost_ms(draft_model, cfg.timing_reps))
            t.append(forward_cost_ms(target_model, max(5, cfg.timing_reps // 4)))
    finally:
        torch.set_num_threads(threads)
    dm, tm = statistics.median(d), statistics.median(t)
    return {"draft_ms": round(dm, 3), "target_ms": round(tm, 3), "c": round(dm / tm, 4),
            "threads": cfg.timing_threads}


def summarize(counts: list[int], k: int, c: float | None = None) -> dict:
    rates = per_position_rates(counts, k)
    out = {"rounds": len(counts), "alpha": round(rates[0], 4),
           "per_position_rate": [round(r, 4) for r in rates],
           "mean_accepted": {str(j): round(mean_accepted(rates, j), 3) for j in range(1, k + 1)},
           "accepted_per_drafted_k": round(sum(counts) / (k * len(counts)), 4)}
    if c is not None:
        out["speedup_estimate"] = {str(j): round(speedup(rates, j, c), 3)
                                   for j in range(1, k + 1)}
    return out


def measure(draft: str, target: str, prompts_path: Path | None, cfg: AcceptanceConfig,
            log=print, at: Placement | None = None) -> dict:
    """Acceptance per temperature plus the cost ratio c, as a JSON-able dict; both models on
    `at` (default: the cpu, float32)."""
    from transformers import AutoTokenizer

    from tools.distill.corpus import Prompt, encode_prompt

    dpaths, tpaths = resolve_model(draft), resolve_model(target)
    if tokenizer_hash(dpaths) != tokenizer_hash(tpaths):
        raise ModelError(f"draft {dpaths.root} and target {tpaths.root} use different "
                         "tokenizers: a draft must share its target's tokenizer")
    tok = AutoTokenizer.from_pretrained(str(tpaths.root))
    texts = load_prompts(prompts_path)
    prompts = [encode_prompt(tok, Prompt("chat", t, "heldout"), cfg.max_prompt_tokens)
               for t in texts]
    at = place("cpu", "float32") if at is None else at
    draft_model = LlamaModel.load(dpaths, at.dtype, device=at.device)
    target_model = LlamaModel.load(tpaths, at.dtype, device=at.device)
    if draft_model.cfg.vocab_size != target_model.cfg.vocab_size:
        raise ModelError("draft and target vocabulary sizes differ")
    stop = tuple(t for t in [tok.eos_token_id] if t is not None)
    cost = measure_cost(draft_model, target_model, cfg)
    log(f"cost: draft {cost['draft_ms']:.2f} ms, target {cost['target_ms']:.2f} ms, "
        f"c = {cost['c']:.3f}")
    result = {"draft": str(dpaths.root), "target": tpaths.root.name,
              "prompts": str(prompts_path or "draft_service/data/heldout_prompts.jsonl"),
              "num_prompts": len(prompts), "config": asdict(cfg), "cost": cost,
              "device": str(at.device), "dtype": at.dtype,
              "temperature": {}}
    for temp in cfg.temperatures:
        start = time.perf_counter()
        counts = simulate(draft_model, target_model, prompts, temp, cfg, stop)
        result["temperature"][str(temp)] = summarize(counts, cfg.k, cost["c"])
        log(f"T={temp}: alpha {result['temperature'][str(temp)]['alpha']:.3f} over "
            f"{len(counts)} rounds ({time.perf_counter() - start:.0f} s)")
    return result


def format_table(result: dict) -> str:
    k = result["config"]["k"]
    lines = [f"draft {result['draft']}  target {result['target']}  "
             f"({result['num_prompts']} held-out prompts)",
             f"cost: draft {result['cost']['draft_ms']:.2f} ms / target "
             f"{result['cost']['target_ms']:.2f} ms per 1-token forward -> c = "
             f"{result['cost']['c']:.3f}", ""]
    head = "".join(f"{j:>7}" for j in range(1, k + 1))
    for temp, r in result["temperature"].items():
        lines += [f"T={temp}  alpha={r['alpha']:.3f}  ({r['rounds']} rounds)",
                  f"  draft position / k  {head}",
                  "  acceptance rate     " + "".join(f"{x:7.3f}" for x in
                                                    r["per_position_rate"]),
                  "  mean accepted       " + "".join(f"{r['mean_accepted'][str(j)]:7.2f}"
                                                    for j in range(1, k + 1))]
        if "speedup_estimate" in r:
            lines.append("  est. speedup        " + "".join(
                f"{r['speedup_estimate'][str(j)]:7.2f}" for j in range(1, k + 1)))
    return "\n".join(lines)
