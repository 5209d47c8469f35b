"""`--dtype int8-bf16`: int8 codes times bf16-rounded activations (kernels/csrc/
int8_bf16_gemm.cpp). The kernel against an fp64 reference of the same arithmetic, rows that do
not depend on their batch, exact codes for weights on a grid, the 8-bit fallback, refusals, and
a tiny model close to fp32."""
import pytest
import torch
from test_llama_tiny import make_checkpoint

from kernels import int8_cpu
from tandem.engine import quant_bf16
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.engine.quant import Int8Weight
from tandem.engine.quant_bf16 import Int8Bf16Weight
from tandem.models import ModelError, resolve_model

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(int8_cpu.load_bf16() is None,
                                 reason="needs a C++ compiler and a CPU with AVX512-BF16")]


def reference(w: Int8Bf16Weight, x: torch.Tensor) -> torch.Tensor:  # [rows, out] float64
    """What the kernel computes, in float64: codes times bf16(x), the zero term on x itself."""
    k = w.shape[1]
    codes = w.q.permute(0, 3, 1, 2, 4).reshape(-1, k).double()[:w.out_features]
    scale = w.scale.movedim(-1, 1).reshape(-1, k // 32)[:w.out_features].double()
    zero = w.zero.movedim(-1, 1).reshape(-1, k // 32)[:w.out_features].double()
    rounded = x.to(torch.bfloat16).double().reshape(len(x), -1, 32)
    exact = x.double().reshape(len(x), -1, 32)
    dots = torch.einsum("mgi,ngi->mng", rounded, (codes - w.center).reshape(len(codes), -1, 32))
    return (dots * scale).sum(-1) + exact.sum(-1) @ zero.T


@pytest.mark.parametrize("out_features", [8, 100, 960, 1536])
def test_the_kernel_computes_codes_times_rounded_activations(out_features):
    torch.manual_seed(out_features)
    w = Int8Bf16Weight.quantize(torch.randn(out_features, 576) * 0.05)
    x = torch.randn(13, 576)
    got = w.linear(x)
    ref = reference(w, x)
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    full = x @ w.dequantize().T  # fp32 activations: only bf16's rounding apart
    assert (got - full).abs().max() < 0.01 * full.abs().max()


@pytest.mark.parametrize("out_features", [96, 100, 24, 960])  # whole and partial tiles
def test_every_row_count_gives_the_bits_of_the_row_alone(out_features):
    torch.manual_seed(out_features)
    w = Int8Bf16Weight.quantize(torch.randn(out_features, 576))
    x = torch.randn(64, 576)
    alone = torch.cat([w.linear(x[i:i + 1]) for i in range(64)])
    for rows in (2, 3, 5, 11, 12, 13, 16, 25, 64):
        assert torch.equal(w.linear(x[:rows]), alone[:rows]), rows


def test_weights_on_a_grid_keep_it_and_8_bit_ones_stay_int8():
    torch.manual_seed(0)
    step, lo = 0.01 + 0.01 * torch.rand(64, 18, 1), 0.1 * torch.randn(64, 18, 1)
    on_16 = (lo + step * torch.randint(0, 16, (64, 18, 32))).reshape(64, 576)
    w = quant_bf16.quantize(on_16)
    assert isinstance(w, Int8Bf16Weight) and w.exact
    torch.testing.assert_close(w.dequantize(), on_16, rtol=0, atol=1e-5)
    codes = torch.randint(0, 256, (64, 18, 32))
    codes[..., :3] = torch.tensor([0, 1, 255])  # every group spans the whole 8-bit grid
    on_256 = (lo + step * codes).reshape(64, 576)
    assert not Int8Bf16Weight.quantize(on_256).exact  # 7-bit codes cannot hold it
    kept = quant_bf16.quantize(on_256)
    assert isinstance(kept, Int8Weight) and kept.exact
    off_grid = torch.randn(64, 576)
    assert isinstance(quant_bf16.quantize(off_grid), Int8Bf16Weight)  # neither is exact
    assert isinstance(quant_bf16.quantize(torch.randn(64, 48)), Int8Weight)  # no 32-groups


def test_no_rows_and_bad_parts():
    w = Int8Bf16Weight.quantize(torch.randn(40, 64))
    assert w.linear(torch.zeros(0, 64)).shape == (0, 40)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int8Bf16Weight.quantize(torch.randn(16, 48))
    with pytest.raises(ValueError, match="center"):
        Int8Bf16Weight(w.q, w.scale, w.zero, 200, 40)
    with pytest.raises(ValueError, match="scale must be"):
        Int8Bf16Weight(w.q, w.scale[:, :1], w.zero, w.center, 40)
    with pytest.raises(ValueError, match="does not fit"):
        Int8Bf16Weight(w.q, w.scale, w.zero, w.center, 80)


def test_tiny_model_stays_close_to_fp32_and_batch_invariant_mode_holds(tmp_path):
    make_checkpoint(tmp_path, "qwen2")  # biases and an untied head
    paths = resolve_model(tmp_path)
    fp32 = LlamaModel.load(paths)
    model = LlamaModel.load(paths, "int8-bf16", batch_invariant=True)
    assert model.weight_dtype == "int8-bf16" and model.dtype == torch.float32
    assert isinstance(model.layers[0].gate_up, Int8Bf16Weight)
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = []
    for m in (fp32, model):
        runner = ModelRunner(m, num_blocks=8, block_size=4)
        runs.append(runner.forward([SeqChunk(ids, 0, list(range(6)), 24)]))
    ref, got = runs
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    one = [runner.forward([SeqChunk(ids[:1], 0, list(range(6)), 1)])]
    one += [runner.forward([SeqChunk([t], i, list(range(6)), 1)]) for i, t in enumerate(ids[1:], 1)]
    assert torch.equal(torch.cat(one), got)  # a token's logits do not depend on its chunk


def test_an_unrunnable_int8_bf16_fails_at_load(monkeypatch):
    monkeypatch.setattr(int8_cpu, "load_bf16", lambda: None)
    with pytest.raises(ModelError, match="AVX512-BF16"):
        quant_bf16.quantizer("int8-bf16")
    assert quant_bf16.quantizer("int8") == Int8Weight.quantize
