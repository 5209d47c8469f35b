"""Weight-only int8: quantization bounds, the packed kernel against the dequantized product on
every path (packed rows, prefill rows, widths the kernel cannot take), and a tiny model whose
int8 logits stay close to fp32."""
import pytest
import torch
import torch.nn.functional as F
from test_llama_tiny import TINY, make_checkpoint

from draft_service.config import DraftConfig
from tandem.engine.linear import LinearRouter
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tandem.engine.quant import MAX_PACKED_ROWS, Int8Weight, compute_dtype
from tandem.models import resolve_model
from verify_service.config import VerifierConfig

pytestmark = pytest.mark.unit


def test_quantize_is_per_channel_and_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different scale
    q = Int8Weight.quantize(w)
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127
    assert q.scale.dtype == torch.bfloat16 and q.scale.shape == (24,)
    # Every row uses its own range: its largest weight lands near +-127.
    assert (q.q.abs().amax(1) >= 126).all()
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale.float()[:, None] / 2 + 1e-7).all()
    assert q.nbytes == 24 * 40 + 2 * 24


@pytest.mark.parametrize("rows", [1, 2, 3, 8, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 40])
@pytest.mark.parametrize("shape", [(64, 48), (17, 32), (96, 576)])
def test_linear_matches_the_dequantized_product(rows, shape):
    torch.manual_seed(rows)
    w, b = torch.randn(*shape), torch.randn(shape[0])
    q = Int8Weight.quantize(w)
    x = torch.randn(rows, shape[1])
    ref = F.linear(x, q.dequantize(), b)
    got = q.linear(x, b)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # bf16 activations inside the packed product: ~2^-8 relative error per term.
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("shape", [(16, 33), (8, 4), (5, 7)])
def test_widths_the_packed_kernel_cannot_take_never_reach_it(shape):
    # The CPU kernel reads the input dimension 8 at a time: other widths return garbage or
    # crash, so they must take the emulated path.
    w = torch.randn(*shape)
    q = Int8Weight.quantize(w)
    assert not q.packable
    x = torch.randn(1, shape[1])
    ref = F.linear(x, q.dequantize())
    assert (q.linear(x) - ref).abs().max() <= 0.02 * ref.abs().max()


def test_a_rows_output_does_not_depend_on_the_batch_it_runs_in():
    # Decode (1 row), verify (k+1 rows) and prefill (> MAX_PACKED_ROWS rows, the emulated
    # GEMM) must give a token the same numbers, or greedy output would follow batch shape.
    torch.manual_seed(3)
    q = Int8Weight.quantize(torch.randn(576, 576))
    x = torch.randn(64, 576)
    alone = q.linear(x[:1])
    for rows in (2, 5, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 64):
        got = q.linear(x[:rows])[:1]
        differ = (got != alone).float().mean().item()
        assert differ <= 0.002, rows  # bf16 rounding-boundary ties at most
        assert ((got - alone).abs() <= alone.abs() * 2**-7).all()


def test_bad_parts_are_refused():
    with pytest.raises(ValueError, match="int8"):
        Int8Weight(torch.zeros(2, 8), torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="scale"):
        Int8Weight(torch.zeros(2, 8, dtype=torch.int8), torch.ones(3, dtype=torch.bfloat16))
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
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
