"""MTP: a tiny random Llama checkpoint carrying a DeepSeek-V3-layout MTP module, built in a temp
dir. The head's logits match a reference of the layout built from transformers' own Llama
block; drafting with it through the real engine step is lossless (greedy identity, the sampled
joint of two tokens) and fails open."""
import json
from collections import Counter

import pytest
import torch
import transformers
from inproc import fails_after, run_sessions, target_joint_top2
from safetensors.torch import save_file

from kernels.paged_attention import build_attention_metadata
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.engine.mtp import MtpHead, mtp_layers
from tandem.models import ModelError, resolve_model
from tandem.proposers.mtp import MtpProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration
TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)


def _rand_norm(n):
    return 1.0 + 0.1 * torch.randn(n)


def build(root, own_head: bool):
    """(main HF model, reference MTP parts) with the checkpoint written to root."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY)
    main = transformers.LlamaForCausalLM(cfg).float().eval()
    main.save_pretrained(root)
    block = transformers.LlamaModel(transformers.LlamaConfig(**dict(TINY, num_hidden_layers=1)))
    block = block.float().eval()
    with torch.no_grad():
        block.norm.weight.copy_(_rand_norm(32))
        for name, p in block.layers[0].named_parameters():
            if "norm" in name:
                p.copy_(_rand_norm(32))
    ref = {"block": block, "enorm": _rand_norm(32), "hnorm": _rand_norm(32),
           "eh_proj": torch.randn(32, 64) * 0.2,
           "head": torch.randn(61, 32) * 0.3 if own_head else main.lm_head.weight.detach()}
    p = f"model.layers.{TINY['num_hidden_layers']}."
    tensors = {p + k: v.detach().clone() for k, v in block.layers[0].state_dict().items()}
    tensors |= {p + "enorm.weight": ref["enorm"], p + "hnorm.weight": ref["hnorm"],
                p + "eh_proj.weight": ref["eh_proj"],
                p + "shared_head.norm.weight": block.norm.weight.detach().clone()}
    if own_head:
        tensors[p + "shared_head.head.weight"] = ref["head"]
    save_file(tensors, str(root / "mtp.safetensors"))
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return main, ref


def reference_logits(main, ref, ids):  # ids [T] -> MTP logits of entries 1..T-1, [T-1, vocab]
    with torch.no_grad():
        h = main.model(ids[None]).last_hidden_state[0]  # the target's final normed hidden
        rms = transformers.models.llama.modeling_llama.LlamaRMSNorm(32, eps=1e-6)

        def norm(x, w):
            rms.weight.data = w
            return rms(x)

        e = main.model.embed_tokens(ids[1:])
        x = torch.cat([norm(e, ref["enorm"]), norm(h[:-1], ref["hnorm"])], -1) @ ref["eh_proj"].T
        out = ref["block"](inputs_embeds=x[None],
                           position_ids=torch.arange(1, len(ids))[None]).last_hidden_state[0]
        return out @ ref["head"].T, h


@pytest.mark.parametrize("own_head", [True, False])
def test_mtp_head_matches_a_reference_of_the_layout(tmp_path, own_head):
    main, ref = build(tmp_path, own_head)
    paths = resolve_model(tmp_path)
    assert mtp_layers(paths) == 1
    target = LlamaModel.load(paths)
    assert target.cfg.num_layers == 2  # the MTP layer is not part of the main stack
    head = MtpHead.load(paths)
    ids = torch.randint(0, 61, (20,), generator=torch.Generator().manual_seed(1))
    want, h = reference_logits(main, ref, ids)
    n = len(ids) - 1
    kv = [(torch.zeros(4, 8, 2, 8), torch.zeros(4, 8, 2, 8))]
    meta = build_attention_metadata([n], [n], [[0, 1, 2]], 8)
    got, _ = head.forward(ids[1:], h[:-1], torch.arange(1, n + 1), meta, kv, torch.arange(n))
    assert (got - want).abs().max().item() < 1e-4


def test_missing_or_absent_mtp_module_is_a_clear_error(tmp_path):
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="declares 0 MTP"):
        MtpHead.load(resolve_model(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    with pytest.raises(ModelError, match="missing enorm.weight"):
        MtpHead.load(resolve_model(tmp_path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    build(root, own_head=False)
    paths = resolve_model(root)
    return LlamaModel.load(paths), paths


FailingMtp = fails_after(MtpProposer, 2, "mtp head lost")


def test_mtp_greedy_is_identical_to_plain_and_fails_open(tiny):
    target, paths = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (5, 12, 30)]
    greedy = SamplingParams(temperature=0.0)
    plain = LocalGenerator(ModelRunner(target, 64, 16)).generate(prompts, greedy, 24)
    mtp = {Method.MTP: MtpProposer.load(paths, 1 << 20)}
    got, drafted, _, link = run_sessions(target, mtp, Method.MTP, prompts, greedy, 24)
    assert got == plain and drafted > 0
    assert link.features_rows > 0  # the verifier shipped the target's hidden states
    failing = FailingMtp.load(paths, 1 << 20)
    got, _, _, _ = run_sessions(target, {Method.MTP: failing}, Method.MTP, prompts, greedy, 24)
    assert got == plain and failing.calls > 2


def test_mtp_sampling_keeps_the_targets_joint_distribution(tiny):
    target, paths = tiny
    prompt = [3, 14, 15, 9, 26]
    sampling = SamplingParams(temperature=1.0, top_k=2)
    joint = target_joint_top2(target, prompt)
    n = 500
    mtp = {Method.MTP: MtpProposer.load(paths, 1 << 20)}
    got, drafted, accepted, _ = run_sessions(target, mtp, Method.MTP, [prompt] * n, sampling, 3,
                                             batch=8)
    counts = Counter(tuple(t[:2]) for t in got)
    assert set(counts) <= set(joint)
    tv = 0.5 * sum(abs(counts[o] / n - p) for o, p in joint.items())
    assert tv < 0.09, f"TV {tv:.3f}"  # E[TV] of an exact sampler ~0.036
    assert drafted > n // 2 and accepted < drafted  # drafts were verified, some rejected
