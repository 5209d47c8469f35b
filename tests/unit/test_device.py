"""--device / --dtype: spec checking, resolution on this host, and the clear errors.

CUDA presence is monkeypatched where a test needs "a host with GPUs" (this machine has none);
the real CUDA paths are the `gpu` tests in tests/integration/test_devices.py.
"""
import argparse

import pytest
import torch

from tandem import device as dev
from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.llama import LlamaModel
from tandem.models import ModelError
from tools.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", " CUDA:1 "])
def test_device_specs_accepted(spec):
    assert dev.check_device_spec(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "tpu", "cpu:0", None])
def test_device_specs_refused_with_the_choices(spec):
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        dev.check_device_spec(spec)


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.resolve_dtype("auto", "cpu") == "float32"
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        dev.resolve_device("cuda")


def test_gpu_host_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="has 2 CUDA GPU"):
        dev.resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert dev.resolve_dtype("auto", "cuda:1") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert dev.resolve_dtype("auto", "cuda:0") == "float16"  # e.g. a T4
    assert dev.resolve_dtype("float32", "cuda:0") == "float32"  # an explicit choice wins
    for cpu_only in ("int8", "int8-bf16"):
        with pytest.raises(ValueError, match=f"{cpu_only} is a CPU weight-only kernel"):
            dev.resolve_dtype(cpu_only, "cuda:0")


def test_place_picks_the_block_size_of_the_device():
    at = dev.place("cpu", "auto")
    assert (at.device, at.dtype, at.block_size) == (torch.device("cpu"), "float32", 16)
    assert dev.place("cpu", "bfloat16", 32).block_size == 32
    with pytest.raises(ValueError, match="block_size"):
        dev.place("cpu", "auto", -1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        dev.place("cpu", "float64")


def test_flags_read_the_environment_and_refuse_bad_values(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_X_DEVICE", "cuda:3")
    p = argparse.ArgumentParser()
    dev.add_device_flags(p, "TANDEM_X")
    assert (p.parse_args([]).device, p.parse_args([]).dtype) == ("cuda:3", "auto")
    assert p.parse_args(["--device", "CPU"]).device == "cpu"
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--device", "gpu0"])
    assert exc.value.code == 2
    assert "auto, cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host can place on cuda")
def test_asking_for_cuda_without_one_is_a_clean_error(capsys):
    assert main(["generate", "hi", "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "sees no CUDA GPU" in err and "Traceback" not in err


def test_configs_validate_the_device():
    from draft_service.config import DraftConfig
    from verify_service.config import VerifierConfig

    assert VerifierConfig().device == "auto" and VerifierConfig().dtype == "auto"
    for make in (VerifierConfig, DraftConfig):
        with pytest.raises(ValueError, match="device must be"):
            make(device="gpu")
        with pytest.raises(ValueError, match="block_size"):
            make(block_size=-16)


def _tiny_weights(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    w = {"embed_tokens.weight": torch.randn(v, h), "norm.weight": torch.ones(h)}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        w |= {p + "input_layernorm.weight": torch.ones(h),
              p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": torch.randn(h, h),
              p + "self_attn.k_proj.weight": torch.randn(kv, h),
              p + "self_attn.v_proj.weight": torch.randn(kv, h),
              p + "self_attn.o_proj.weight": torch.randn(h, h),
              p + "mlp.gate_proj.weight": torch.randn(i, h),
              p + "mlp.up_proj.weight": torch.randn(i, h),
              p + "mlp.down_proj.weight": torch.randn(h, i)}
    return w


TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                   rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                   qkv_bias=False)


def test_cpu_only_kernels_refuse_other_devices():
    # "meta" stands in for a GPU: the refusal comes before any weight is moved.
    for kwargs in ({"dtype": "int8"}, {"dtype": "int8-bf16"}, {"batch_invariant": True}):
        with pytest.raises(ModelError, match="run on the cpu only"):
            LlamaModel(TINY, _tiny_weights(TINY), device="meta", **kwargs)


def test_weights_rope_tables_and_kv_cache_follow_the_device():
    from tandem.engine.model_runner import ModelRunner

    model = LlamaModel(TINY, _tiny_weights(TINY), device="meta")
    runner = ModelRunner(model, 4, 16)
    tensors = [model.embed, model.cos, model.sin, model.layers[0].qkv, model.layers[0].down,
               *runner.kv_cache[0]]
    assert {t.device.type for t in tensors} == {"meta"}
    assert runner.device == torch.device("meta")
