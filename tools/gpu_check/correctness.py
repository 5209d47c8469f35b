"""Phase `correctness`: the device against the CPU fp32 reference on tiny random models.

- logits of every served family (a chunked prefill, a 3-token verification chunk, decodes) in
  fp32 on the device vs the CPU; greedy text the same; bf16 argmax agreement on a GPU;
- greedy and seeded text with n-gram, draft-model, EAGLE and Medusa (tree) speculation
  identical to plain decoding on the device (tools/gpu_check/spec_loop.py: the real Executor);
- tree verification: each tree node's logits equal a chain forward over its path;
- logprobs of the emitted tokens equal the CPU's;
- the rejection sampler's output distribution is the target's (total variation bound).
"""
from __future__ import annotations

import torch

from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams
from tools.gpu_check.models import TINY_FAMILIES, tiny_family
from tools.gpu_check.runner import PhaseContext
from tools.gpu_check.spec_loop import generate

PROMPT = [5, 9, 14, 20, 27, 5, 9, 14, 20, 27, 5, 9, 33, 41]
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
SPEC_FAMILIES = ("llama3-rope", "gemma2")  # one plain layout, one softcapped/windowed
FP32_ATOL = 2e-3  # TF32-free fp32 on a GPU stays well within this of the CPU


def run(ctx: PhaseContext) -> None:
    for step in (_logits, _speculation, _tree, _logprobs, _rejection):
        if ctx.out_of_time():
            return
        step(ctx)


def _all_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] on the CPU
    runner = ModelRunner(model, 8, 16)
    table = list(range(8))
    cut = len(ids) - 6
    parts = [runner.forward([SeqChunk(ids[:cut], 0, table, cut)]),
             runner.forward([SeqChunk(ids[cut:cut + 3], cut, table, 3)])]
    parts += [runner.forward([SeqChunk([ids[p]], p, table)]) for p in range(cut + 3, len(ids))]
    return torch.cat(parts).float().cpu()


def _logits(ctx: PhaseContext) -> None:
    ids = torch.randint(1, 101, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = ctx.result.setdefault("families", {})
    for name in TINY_FAMILIES:
        if ctx.out_of_time():
            return
        ref_model, dev_model = tiny_family(name), tiny_family(name, ctx.device)
        diff = (_all_logits(dev_model, ids) - _all_logits(ref_model, ids)).abs().max().item()
        ref_text = generate(ModelRunner(ref_model, 8, 16), PROMPT, 24, GREEDY).tokens
        dev_text = generate(ModelRunner(dev_model, 8, 16), PROMPT, 24, GREEDY).tokens
        rows[name] = {"max_abs_logit_diff": diff, "greedy_same": dev_text == ref_text}
        ctx.check(f"logits/{name}", diff < FP32_ATOL, diff)
        ctx.check(f"greedy/{name}", dev_text == ref_text)
        if ctx.device.type == "cuda":
            bf16 = _all_logits(tiny_family(name, ctx.device, torch.bfloat16), ids)
            agree = (bf16.argmax(-1) == _all_logits(ref_model, ids).argmax(-1)).float().mean()
            rows[name]["bf16_argmax_agreement"] = agree.item()
            ctx.check(f"bf16/{name}", agree.item() >= 0.8, agree.item())
        ctx.log(f"  {name}: max |logit diff| {diff:.2e}, greedy same {dev_text == ref_text}")


def _proposers(model, method: str):
    """(proposer, medusa heads) for a method, on the target's device."""
    from tandem.proposers.draft_model import DraftModelProposer
    from tandem.proposers.eagle import EagleProposer
    from tandem.proposers.ngram import NgramProposer
    from tools.gpu_check.heads import eagle_head, medusa_heads

    if method == "ngram":
        return NgramProposer(), None
    if method == "draft_model":  # the target drafting for itself: the bonus path exercised
        return DraftModelProposer(ModelRunner(model, 8, 16)), None
    if method == "eagle":
        return EagleProposer(eagle_head(model), 8, 16), None
    return None, medusa_heads(model)


def _speculation(ctx: PhaseContext) -> None:
    rows = ctx.result.setdefault("speculation", {})
    for family in SPEC_FAMILIES:
        model = tiny_family(family, ctx.device)
        for sampling, label in ((GREEDY, "greedy"), (SEEDED, "seeded")):
            plain = generate(ModelRunner(model, 8, 16), PROMPT, 24, sampling).tokens
            for method in ("ngram", "draft_model", "eagle", "medusa"):
                if ctx.out_of_time():
                    return
                proposer, medusa = _proposers(model, method)
                run = generate(ModelRunner(model, 8, 16), PROMPT, 24, sampling, proposer, medusa)
                key = f"{family}/{method}/{label}"
                rows[key] = {"same_as_plain": run.tokens == plain, "drafted": run.drafted,
                             "accepted": run.accepted}
                ctx.check(f"speculation/{key}", run.tokens == plain)
        ctx.log(f"  {family}: speculation checked ({len(rows)} runs so far)")


def _tree(ctx: PhaseContext) -> None:
    """A 6-node tree's logits (one forward, the tree mask) vs a chain forward per path."""
    from kernels.attention import kernel_for
    from kernels.paged_attention import ancestor_mask, build_attention_metadata

    model = tiny_family("llama3-rope", ctx.device)
    parents, tokens = (-1, 0, 0, 1, 1, 2), [11, 12, 13, 14, 15, 16]
    runner = ModelRunner(model, 8, 16)
    runner.forward([SeqChunk(PROMPT, 0, list(range(8)))])
    got = runner.forward([SeqChunk(tokens, len(PROMPT), list(range(8)), 6, parents=parents)])
    worst = 0.0
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        chain = ModelRunner(model, 8, 16).forward([SeqChunk(PROMPT + path, 0, list(range(8)))])
        worst = max(worst, (chain[0] - got[i]).abs().max().item())
    meta = build_attention_metadata([6], [len(PROMPT) + 6], [list(range(8))], 16,
                                    [ancestor_mask(parents)])
    q = torch.zeros(6, model.cfg.num_heads, model.cfg.head_dim, device=ctx.device)
    kernel = kernel_for(q, runner.kv_cache[0][0], meta)
    ctx.result["tree"] = {"max_abs_logit_diff": worst, "kernel": kernel}
    ctx.check("tree/nodes_equal_their_paths", worst < FP32_ATOL, worst)
    if ctx.device.type == "cuda":
        ctx.check("tree/masked_kernel_on_cuda", kernel == "flex", kernel)


def _logprobs(ctx: PhaseContext) -> None:
    def run(device):
        return generate(ModelRunner(tiny_family("qwen3", device), 8, 16), PROMPT, 16, SEEDED,
                        logprobs=True)

    ref, got = run("cpu"), run(ctx.device)
    diff = max(abs(a - b) for a, b in zip(ref.logprobs, got.logprobs))
    ctx.result["logprobs"] = {"max_abs_diff": diff, "tokens_same": ref.tokens == got.tokens,
                              "count": len(got.logprobs)}
    ctx.check("logprobs/values", len(got.logprobs) == 16 and diff < FP32_ATOL, diff)
    ctx.check("logprobs/tokens", ref.tokens == got.tokens)


def _rejection(ctx: PhaseContext) -> None:
    """n sequences of 2 drafts drawn from q, verified against p in one call: the first
    emitted token must be distributed as p[0], and accepted at rate sum(min(p, q))."""
    from kernels.rejection import rejection_sample

    n, vocab, k = (20_000 if ctx.tiny or ctx.device.type == "cpu" else 400_000), 16, 2
    gen = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(p[:k].log() + 1.5 * torch.randn(k, vocab, generator=gen), -1)
    drafts = torch.stack([torch.multinomial(q[j], n, True, generator=gen) for j in range(k)], 1)
    dev = ctx.device
    torch.manual_seed(11)
    out = rejection_sample(drafts.reshape(-1).to(dev), torch.arange(0, n * k + 1, k, device=dev),
                           p.repeat(n, 1).to(dev), q.repeat(n, 1).to(dev),
                           torch.zeros(n, dtype=torch.bool, device=dev))
    first = out.output_token_ids[:, 0].cpu()
    freq = torch.bincount(first, minlength=vocab).double() / n
    tv = 0.5 * (freq - p[0].double()).abs().sum().item()
    bound = (vocab / n) ** 0.5
    rate = (out.num_accepted >= 1).double().mean().item()
    expected = torch.minimum(p[0], q[0]).sum().item()
    ctx.result["rejection"] = {"n": n, "tv": tv, "tv_bound": bound, "acceptance": rate,
                               "expected_acceptance": expected}
    ctx.check("rejection/distribution", tv < bound, {"tv": tv, "bound": bound})
    ctx.check("rejection/acceptance_rate", abs(rate - expected) < 4 * (0.25 / n) ** 0.5 + 1e-3,
              {"got": rate, "expected": expected})
