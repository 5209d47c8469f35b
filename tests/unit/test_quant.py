"""Weight-only int8: quantization bounds, the C++ kernel against the dequantized product on every
path (kernel rows, prefill rows, widths without 32-wide groups), batch invariance, and a tiny
model whose int8 logits stay close to fp32."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_llama_tiny import TINY, make_checkpoint

from draft_service.config import DraftConfig
from kernels import int8_cpu
from tandem.engine.linear import LinearRouter
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tandem.engine.quant import KERNEL_SLICE_ROWS, Int8Weight, compute_dtype
from tandem.models import resolve_model
from verify_service.config import VerifierConfig

pytestmark = pytest.mark.unit


def test_quantize_is_per_group_and_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(21, 64) * torch.logspace(-3, 1, 64)  # groups of very different range
    w[3, :32] = 0.25  # a constant group
    q = Int8Weight.quantize(w)
    assert q.q.dtype == torch.uint8 and q.group == 32 and q.shape == (21, 64)
    # 21 channels pack into 3 blocks of 8 (the last padded), 2 groups each.
    assert tuple(q.q.shape) == (3, 2, 32, 8) and tuple(q.scale.shape) == (3, 2, 8)
    # Every group uses its own range: its extremes land on codes 0 and 255.
    varying = q.scale > 0
    assert (q.q.amin(2)[varying] == 0).all() and (q.q.amax(2)[varying] == 255).all()
    deq = q.dequantize()
    assert deq.shape == w.shape
    step = torch.stack([q.scale[b, :, r] for b in range(3) for r in range(8)])[:21]
    assert ((deq - w).abs() <= step.repeat_interleave(32, dim=1) / 2 + 1e-6).all()
    assert torch.equal(deq[3, :32], w[3, :32])
    assert q.nbytes == 24 * 64 + 4 * 2 * 24 * 2


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "three_levels"])
def test_weights_already_on_a_grid_keep_it_exactly(kind):
    """Q4_1-like (16 levels above a minimum), Q8_0-like (symmetric, bell-shaped codes in
    +-127) and sparse grids: the codes reproduce every weight up to fp32 rounding, even in
    groups that miss the grid's extremes."""
    torch.manual_seed(len(kind))
    d = torch.rand(40, 4, 1) * 0.01 + 1e-4  # a step per 32-group, as fp16 scales would be
    m = torch.randn(40, 4, 1) * 0.05
    if kind == "q8_0":
        m, codes = 0.0, (torch.randn(40, 4, 32) * 20).round().clamp(-127, 127)
    else:
        codes = torch.randint(0, 16 if kind == "q4_1" else 3, (40, 4, 32)).float()
    codes[:5] = codes[:5].clamp(2, 9)  # groups without the extremes
    w = (m + d * codes).reshape(40, 128).float()
    q = Int8Weight.quantize(w)
    # fp32 rounding of q * step + min, against min/max codes' error of up to span / 510.
    assert (q.dequantize() - w).abs().max() <= 1e-5 * w.abs().max()
    assert q.exact  # what --dtype auto needs to load int8 (tandem.engine.exact_dtype)


def test_off_grid_groups_use_their_range():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0] * 8, [0.0, 0.3, 1.0, 2.71828] * 8])
    q = Int8Weight.quantize(w)
    assert torch.equal(q.dequantize()[0], w[0])  # 4 levels, step 1: exact
    assert q.scale[0, 0, 1] == pytest.approx(2.71828 / 255)  # no grid: min/max codes
    assert (q.dequantize()[1] - w[1]).abs().max() <= 2.71828 / 510 + 1e-6
    assert not q.exact and Int8Weight.quantize(w[:1]).exact


def _snap_to_grid(path):
    """Round every matrix of a checkpoint to 16 levels per 32-group, as a Q4_1 one is."""
    from safetensors.torch import load_file, save_file

    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[1] % 32 == 0:
            g = t.reshape(t.shape[0], -1, 32)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            step = ((hi - lo) / 15).clamp_min(1e-8)
            tensors[name] = (lo + ((g - lo) / step).round() * step).reshape(t.shape)
    save_file(tensors, file, metadata={"format": "pt"})


def test_dtype_auto_loads_int8_only_where_every_weight_is_exact(tmp_path):
    from tandem.device import place
    from tandem.engine.exact_dtype import load_target

    make_checkpoint(tmp_path, "llama")  # random weights: not on any grid
    at = place("cpu", "auto")
    assert at.auto_dtype and not place("cpu", "float32").auto_dtype
    assert load_target(resolve_model(tmp_path), at).weight_dtype == "float32"
    _snap_to_grid(tmp_path)
    model = load_target(resolve_model(tmp_path), at)
    assert model.weight_dtype == "int8" and model.inexact_int8() == []
    fp32 = load_target(resolve_model(tmp_path), place("cpu", "float32"))
    assert fp32.weight_dtype == "float32"  # an explicit dtype is kept


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 65, 200, KERNEL_SLICE_ROWS + 1])
@pytest.mark.parametrize("shape", [(64, 64), (17, 96), (1728, 576), (13, 40), (5, 33)])
def test_linear_matches_the_dequantized_product(rows, shape):
    torch.manual_seed(rows)
    w, b = torch.randn(*shape), torch.randn(shape[0])
    q = Int8Weight.quantize(w)
    x = torch.randn(rows, shape[1])
    ref = F.linear(x, q.dequantize(), b)
    got = q.linear(x, b)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)  # fp32 throughout


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: int8 falls back")
def test_the_kernel_is_built_and_used_on_this_machine(monkeypatch):
    # With a compiler (CI has one) the fast path must really run, not the fallback.
    assert int8_cpu.load() is not None
    q = Int8Weight.quantize(torch.randn(32, 64))
    calls = []
    real = int8_cpu.load()
    monkeypatch.setattr(int8_cpu, "load", lambda: calls.append(1) or real)
    q.linear(torch.randn(2, 64))
    assert calls


def test_a_rows_output_does_not_depend_on_the_batch_it_runs_in():
    # Decode (1 row), verify (k+1 rows) and prefills of any length must give a token
    # bit-identical numbers, or greedy output would follow batch shape (and a prompt's cached
    # KV would differ from what decoding it would have written).
    torch.manual_seed(3)
    q = Int8Weight.quantize(torch.randn(100, 576))  # 100 channels: a partial block of 8 too
    total = KERNEL_SLICE_ROWS + 37  # past one slice
    x = torch.randn(total, 576)
    alone = torch.cat([q.linear(x[i:i + 1]) for i in range(total)])
    for rows in (2, 3, 4, 5, 16, 64, 65, 200, total):  # fused (<= 3 rows), buffered, sliced
        assert torch.equal(q.linear(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("out_features", [8, 100])
def test_no_rows_give_an_empty_product(out_features):
    # A prefill chunk that samples nothing asks the LM head for zero rows.
    q = Int8Weight.quantize(torch.randn(out_features, 64))
    out = q.linear(torch.randn(0, 64))
    assert out.shape == (0, out_features) and out.dtype == torch.float32


def test_bad_parts_are_refused():
    codes = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)  # [blocks, groups, group, BLOCK]
    ones, zeros = torch.ones(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="uint8"):
        Int8Weight(codes.float(), ones, zeros, 8)
    with pytest.raises(ValueError, match="scale"):
        Int8Weight(codes, torch.ones(1, 2, 8), zeros, 8)
    with pytest.raises(ValueError, match="does not fit"):
        Int8Weight(codes, ones, zeros, 9)
    with pytest.raises(ValueError, match="dtype must be one of"):
        compute_dtype("int4")
    with pytest.raises(ValueError, match="dtype"):
        VerifierConfig(dtype="int4")
    with pytest.raises(ValueError, match="dtype"):
        DraftConfig(dtype="fp8")
    assert VerifierConfig(dtype="int8").dtype == DraftConfig(dtype="int8").dtype == "int8"
    assert compute_dtype("int8") == torch.float32


def test_router_sends_int8_weights_to_their_kernel_and_tunes_around_them():
    router = LinearRouter()
    q = Int8Weight.quantize(torch.randn(32, 16))
    router.tune([[q]], rows=(1, 2))  # nothing to time: must not touch the int8 weight
    assert router.use_mm == {}
    x = torch.randn(2, 16)
    torch.testing.assert_close(router(x, q), q.linear(x))


def test_int8_tiny_model_stays_close_to_fp32(tmp_path):
    make_checkpoint(tmp_path, "qwen2")  # biases and an untied head: every quantized path
    paths = resolve_model(tmp_path)
    fp32, int8 = LlamaModel.load(paths), LlamaModel.load(paths, "int8")
    assert int8.dtype == torch.float32 and int8.weight_dtype == "int8"
    assert isinstance(int8.layers[0].gate_up, Int8Weight) and isinstance(int8.lm_head, Int8Weight)
    assert int8.embed.dtype == torch.float32
    assert kv_bytes_per_token(int8) == kv_bytes_per_token(fp32)  # the KV cache stays fp32
    ids = torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(2))
    out = []
    for model in (fp32, int8):
        runner = ModelRunner(model, num_blocks=8, block_size=4)
        prefill = runner.forward([SeqChunk(ids[:20].tolist(), 0, list(range(6)), 20)])
        verify = runner.forward([SeqChunk(ids[20:].tolist(), 20, list(range(6)), 4)])
        out.append(torch.cat([prefill, verify]))
    ref, got = out
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_invariant_linear_rows_do_not_depend_on_the_row_count():
    from tandem.engine.linear import invariant_linear, measure_invariant_rows

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(40, 64, generator=g)
    rows = measure_invariant_rows([w])
    assert rows >= 1
    full = invariant_linear(x, w, None, rows)
    for m in (1, 2, 3, 5, 17):
        assert torch.equal(invariant_linear(x[:m], w, None, rows), full[:m])
    router = LinearRouter(invariant_rows=rows)
    assert torch.equal(router(x[:1], w), full[:1])
    int8 = Int8Weight.quantize(w)
    if int8_cpu.load() is not None:  # the kernel: large products in slices, same per row
        big = torch.randn(150, 64, generator=g)
        assert torch.equal(router(big, int8)[:3], router(big[:3], int8))
