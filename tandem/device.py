"""Where a model runs and in what precision: `--device` and `--dtype` for every command.

`--device auto` (the default) is the first CUDA GPU when torch sees one, else the CPU;
`cpu`, `cuda` and `cuda:N` pin it. `--dtype auto` is float32 on the CPU (bf16 matmuls there
are slower than fp32), except that a target whose every weight group is exact in int8 loads
as int8 (the same weights, a third of the bytes per decode step: tandem.engine.exact_dtype),
and bfloat16 on a GPU (float16 where the GPU has no bf16). Weights, the KV cache, sampling
and rejection all live on the chosen device; the seeded random streams stay on the CPU so a
seed gives the same text on any device.

The spec strings are checked without torch (configs validate in __post_init__); resolving
them needs torch and says clearly what is missing ("cuda:3" on a 1-GPU host, "cuda" on a
CPU-only build).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from tandem.envflags import add_flag

DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "int8", "int8-bf16")
# int8 weights on our CPU kernels: fp32 activations, or bf16 ones (tandem.engine.quant_bf16)
INT8_DTYPES = ("int8", "int8-bf16")


def check_device_spec(spec: str) -> str:
    """`spec` if it names a device Tandem can place a model on; else ValueError (argparse
    turns it into a usage error)."""
    if not isinstance(spec, str) or not DEVICE_SPEC.match(spec.strip().lower()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    return spec.strip().lower()


def check_dtype_spec(spec: str) -> str:
    if spec not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {spec!r}")
    return spec


def _arg_type(check):
    def convert(value: str) -> str:
        try:
            return check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = check.__name__  # argparse names the type in its error
    return convert


def add_device_flags(parser: argparse.ArgumentParser, env_prefix: str,
                     dtype_default: str = "auto", dtype_help: str = "") -> None:
    """--device and --dtype, read from ${env_prefix}_DEVICE / _DTYPE."""
    add_flag(parser, "--device", f"{env_prefix}_DEVICE", "auto", _arg_type(check_device_spec),
             "where the model runs: auto (CUDA when present, else cpu), cpu, cuda, cuda:N")
    add_flag(parser, "--dtype", f"{env_prefix}_DTYPE", dtype_default,
             _arg_type(check_dtype_spec),
             dtype_help or "weight dtype: auto (cpu: int8 where the target's weights are exact "
                           "in it, else float32; bfloat16 on cuda), float32, "
                           "bfloat16, float16, int8 (weight-only, cpu), int8-bf16 (int8 "
                           "weights, activations rounded to bf16 for the products: faster "
                           "prefills and batches on cpus with AVX512-BF16)")


def resolve_device(spec: str = "auto"):
    """The torch.device for a spec; ValueError when it names a GPU this host lacks."""
    import torch

    spec = check_device_spec(spec)
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for, but torch sees no CUDA GPU here "
                         f"(torch {torch.__version__}); use --device cpu")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {spec!r} asked for, but this host has {count} CUDA GPU(s)")
    return torch.device("cuda", index)


def resolve_dtype(spec: str, device) -> str:
    """The weight dtype name (tandem.engine.quant.WEIGHT_DTYPES) for a spec on a device."""
    import torch

    spec = check_dtype_spec(spec)
    on_gpu = torch.device(device).type == "cuda"
    if spec == "auto":
        if not on_gpu:
            return "float32"
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if spec in INT8_DTYPES and on_gpu:
        raise ValueError(f"dtype {spec} is a CPU weight-only kernel; on a GPU use bfloat16 or "
                         "float16")
    return spec


@dataclass(frozen=True)
class Placement:
    """Where one process's models go: resolved once at start-up, logged, then passed down."""

    device: Any  # torch.device
    dtype: str  # a tandem.engine.quant.WEIGHT_DTYPES name
    block_size: int  # KV cache block size in tokens
    # --dtype was auto: a target's loader may still pick a faster exact dtype (int8 on the
    # CPU where every weight group is exact: tandem.engine.exact_dtype.load_target).
    auto_dtype: bool = False

    def __str__(self) -> str:
        return f"{self.device} {self.dtype}, KV blocks of {self.block_size}"


def place(device: str = "auto", dtype: str = "auto", block_size: int = 0) -> Placement:
    """Resolve --device/--dtype/--block-size (0 = the device's: 256 for flash-attn's paged
    kernel on a GPU, 16 on the CPU)."""
    from kernels.attention import default_block_size

    dev = resolve_device(device)
    if block_size < 0:
        raise ValueError(f"block_size must be >= 0 (0 = the device's), got {block_size}")
    return Placement(dev, resolve_dtype(dtype, dev), block_size or default_block_size(dev),
                     auto_dtype=check_dtype_spec(dtype) == "auto")


def synchronize(device) -> None:
    """Wait for queued GPU work, so a wall-clock timing covers it (no-op on the CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
