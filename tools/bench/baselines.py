"""The in-process peers, all through transformers `generate` on the same prompts:

- plain target decoding (the everyday baseline);
- assisted generation with the same draft the draft worker serves (`assistant_model=`);
- prompt lookup decoding (`prompt_lookup_num_tokens=`), the in-process twin of our n-gram.

Timing comes from a streamer (each `put` is one step's new tokens), so TTFT and decode
tokens/s are defined exactly as for the streamed HTTP responses.

Every loader takes a tandem.device.Placement (None: the cpu in float32, as before --device);
on a GPU the clock is read only after the queued work is done (tandem.device.synchronize).
"""
from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from tandem.device import INT8_DTYPES, Placement, synchronize
from tools.bench.stats import decode_tps

PEER_METHODS = ("plain", "assisted", "prompt_lookup")


class _Clock(BaseStreamer):
    """Records when each step's tokens exist; the first `put` is the prompt itself."""

    def __init__(self, device="cpu"):
        self.device = device
        synchronize(device)  # earlier GPU work is not this generation's
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        synchronize(self.device)
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self):
        pass


class _MappedEmbedding(torch.nn.Module):
    """Target ids in, draft rows looked up (ids outside the draft vocabulary use its unk row)."""

    def __init__(self, embed: torch.nn.Embedding, input_map: torch.Tensor):
        super().__init__()
        self.embed = embed
        self.register_buffer("input_map", input_map, persistent=False)

    def forward(self, ids):
        return self.embed(self.input_map[ids])


class _ScatterHead(torch.nn.Module):
    """The draft's small head, scattered into the target vocabulary; tokens the draft cannot
    produce get -inf, exactly as tandem.engine.llama.LlamaModel does. The matmul stays the
    draft's own size, so the peer pays the same head cost as our draft worker."""

    def __init__(self, head: torch.nn.Linear, target_ids: torch.Tensor, vocab: int):
        super().__init__()
        self.weight = head.weight
        self.vocab = vocab
        self.register_buffer("target_ids", target_ids, persistent=False)

    def forward(self, hidden):
        small = hidden @ self.weight.T
        out = small.new_full((*small.shape[:-1], self.vocab), float("-inf"))
        out[..., self.target_ids] = small
        return out


def peer_dtype(at: Placement | None) -> torch.dtype:
    """The transformers peers' dtype: Tandem's, except int8 and int8-bf16 (our CPU kernels):
    float32."""
    if at is None or at.dtype in INT8_DTYPES:
        return torch.float32
    return getattr(torch, at.dtype)


def _device(at: Placement | None) -> torch.device:
    return torch.device("cpu") if at is None else at.device


def load_target(path: str | Path, at: Placement | None = None):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=peer_dtype(at))
    return model.to(_device(at)).eval()


def load_assistant(draft_dir: str | Path, target_vocab: int, at: Placement | None = None):
    """The draft as transformers loads it. A truncated-vocabulary draft (draft_vocab.json)
    speaks draft row ids, so it is re-wired to speak target ids, as our workers do."""
    from tandem.engine.draft_vocab import DraftVocab

    model = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=peer_dtype(at)).eval()
    vocab = DraftVocab.read(Path(draft_dir))
    if vocab is not None:  # even a full-size one may order its rows differently
        inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        head = model.lm_head
        inner.embed_tokens = _MappedEmbedding(inner.embed_tokens, vocab.input_map())
        model.lm_head = _ScatterHead(head, torch.tensor(vocab.target_ids), target_vocab)
        model.config.vocab_size = target_vocab
        model.config.tie_word_embeddings = False
    return model.to(_device(at))  # the re-wiring's index buffers too


def _generation_config(model, tokens: int, temperature: float, method: str, k: int):
    """Exactly `tokens` new tokens (EOS does not stop, like the gateway's ignore_eos) with the
    request's sampling: temperature only, no top-k / top-p, as Tandem's defaults."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.max_new_tokens, cfg.min_new_tokens = tokens, None
    cfg.eos_token_id = []  # not None: generate() would fill None from the model's defaults
    if cfg.pad_token_id is None:
        cfg.pad_token_id = model.config.eos_token_id
    cfg.do_sample = temperature > 0
    cfg.temperature = temperature if temperature > 0 else None
    cfg.top_k, cfg.top_p = (0, 1.0) if temperature > 0 else (None, None)
    if method == "prompt_lookup":
        cfg.prompt_lookup_num_tokens = k
    elif method == "assisted":
        cfg.num_assistant_tokens = k  # its heuristic schedule then adapts it, like ours
    return cfg


@torch.inference_mode()
def run_peer(model, assistant, ids: list[int], method: str, tokens: int, temperature: float,
             k: int, seed: int = 0) -> dict:
    """One generation; returns tokens, TTFT and decode tokens/s."""
    if method not in PEER_METHODS:
        raise ValueError(f"unknown peer method {method!r}")
    torch.manual_seed(seed)
    cfg = _generation_config(model, tokens, temperature, method, k)
    kwargs = {"assistant_model": assistant} if method == "assisted" else {}
    clock = _Clock(model.device)
    out = model.generate(torch.tensor([ids], device=model.device), generation_config=cfg,
                         streamer=clock, **kwargs)
    n = int(out.shape[1]) - len(ids)
    first = clock.times[0] if clock.times else time.perf_counter()
    last = clock.times[-1] if clock.times else first
    return {"tokens": n, "ttft_s": first - clock.start,
            "decode_tps": decode_tps(n, first, last), "steps": len(clock.times),
            "e2e_s": last - clock.start}


def _forward_ms(model, reps: int, prefix: int = 128) -> float:
    """Median batch-1, 1-token forward on a cached prefix through our ModelRunner (ms)."""
    import statistics

    from kernels.attention import default_block_size
    from tandem.engine.model_runner import ModelRunner, SeqChunk

    block_size = default_block_size(model.device)
    blocks = -(-(prefix + 2) // block_size)
    runner = ModelRunner(model, num_blocks=blocks, block_size=block_size)
    table = list(range(blocks))
    runner.forward([SeqChunk([(7 * j) % 1000 + 100 for j in range(prefix)], 0, table, 1)])
    times = []
    for _ in range(reps):
        synchronize(model.device)
        start = time.perf_counter()
        runner.forward([SeqChunk([42], prefix, table, 1)])
        synchronize(model.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _placement(at: Placement | None) -> Placement:
    from tandem.device import place

    return place("cpu", "float32") if at is None else at


def measure_eagle_c(head_dir: str, target: str, reps: int = 40,
                    at: Placement | None = None) -> dict:
    """c for the EAGLE head: one drafting step of the real proposer (one new entry, its LM
    head and sampling) against the target's batch-1 1-token forward, interleaved, 1 thread."""
    from draft_service.config import DraftConfig
    from tandem.engine.llama import LlamaModel
    from tandem.models import ModelPaths, resolve_model
    from tandem.proposers.eagle import EagleProposer
    from tandem.spec import DraftRequest
    from tools.distill.acceptance import forward_cost_ms

    at = _placement(at)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prop = EagleProposer.load(ModelPaths(Path(head_dir)), 64 << 20, at.block_size,
                                  draft_vocab=DraftConfig.eagle_vocab,  # as a worker serves it
                                  device=at.device)
        tm = LlamaModel.load(resolve_model(target), at.dtype, device=at.device)
        feats = torch.randn(128 + 4 * reps, prop.feature_size)
        tokens = [(7 * j) % 1000 + 100 for j in range(128)]
        prop.propose([DraftRequest("c", tokens, len(tokens), 1, features=feats[:127])])
        d, t = [], []
        for _ in range(3):
            synchronize(at.device)
            start = time.perf_counter()
            for _ in range(reps):
                tokens.append(tokens[-1] % 1000 + 100)
                prop.propose([DraftRequest("c", tokens, len(tokens), 1,
                                           features=feats[:len(tokens) - 1])])
            synchronize(at.device)
            d.append((time.perf_counter() - start) / reps * 1e3)
            t.append(forward_cost_ms(tm, max(5, reps // 4)))
    finally:
        torch.set_num_threads(threads)
    dm, tm_ms = statistics.median(d), statistics.median(t)
    return {"draft_ms": round(dm, 3), "target_ms": round(tm_ms, 3), "c": round(dm / tm_ms, 4),
            "threads": 1}


def measure_layer_skip_c(target: str, reps: int = 40, at: Placement | None = None) -> dict:
    """c of the layer-skip draft the verifier serves (the set found with the target), as
    measure_c times a draft model; {} when the target has no skip set."""
    from tandem.engine.layer_skip import SkipSet, find_skip_set, skip_view
    from tandem.engine.llama import LlamaModel
    from tandem.models import resolve_model
    from tools.distill.acceptance import AcceptanceConfig, measure_cost

    paths = resolve_model(target)
    found = find_skip_set(paths)
    if found is None:
        return {}
    at = _placement(at)
    skip, tm = SkipSet.read(found), LlamaModel.load(paths, at.dtype, device=at.device)
    cost = measure_cost(skip_view(tm, skip), tm, AcceptanceConfig(timing_reps=reps))
    return cost | {"skip": list(skip.skip), "file": str(found)}


def measure_c(draft: str, target: str, reps: int = 40, at: Placement | None = None) -> dict:
    """The draft/target cost ratio c for Leviathan's formula: median batch-1 1-token forward
    of each through our runner on one thread. tools.distill.acceptance's measurement when it
    is there (so this report and `tandem acceptance` agree), else the same thing here."""
    from tandem.engine.llama import LlamaModel
    from tandem.models import resolve_model

    at = _placement(at)
    dm = LlamaModel.load(resolve_model(draft), at.dtype, device=at.device)
    tm = LlamaModel.load(resolve_model(target), at.dtype, device=at.device)
    try:
        from tools.distill.acceptance import AcceptanceConfig, measure_cost

        return measure_cost(dm, tm, AcceptanceConfig(timing_reps=reps))
    except (ImportError, TypeError, AttributeError):  # that module is still being finished
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            d, t = _forward_ms(dm, reps), _forward_ms(tm, max(5, reps // 4))
        finally:
            torch.set_num_threads(threads)
        return {"draft_ms": d, "target_ms": t, "c": d / t, "threads": 1}


def measure_verify_curve(target: str, q_max: int, threads: int = 1, reps: int = 5,
                         at: Placement | None = None, context: int = 128) -> dict:
    """The target's forward time over q new tokens after `context` cached ones, q = 1..q_max
    (ms, medians): what a verification round of q - 1 nodes costs against a plain step. Timed
    as the verifier calibrates its cost model at start-up (calibration.calibrate), on as many
    threads as each worker of the cluster gets."""
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import ModelRunner
    from tandem.models import resolve_model
    from verify_service.policy.calibration import calibrate

    at = _placement(at)
    model = LlamaModel.load(resolve_model(target), at.dtype, device=at.device)
    runner = ModelRunner(model, -(-(context + q_max) // at.block_size), at.block_size)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ms = calibrate(runner, tuple(range(1, q_max + 1)), reps=reps, context=context)
    finally:
        torch.set_num_threads(saved)
    return {"ms": {q: round(v, 3) for q, v in ms.items()}, "threads": threads,
            "context": context, "reps": reps}
