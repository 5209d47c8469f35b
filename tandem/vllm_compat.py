"""vLLM's speculative-decoding configuration on Tandem's command lines.

`--speculative-config JSON` (vLLM's `SpeculativeConfig` keys) on `tandem verifier` and
`tandem up`, read into `SpeculativeConfig` and mapped onto Tandem's own flags:

- `method`: eagle and eagle3 are method eagle (a draft worker's `--eagle DIR`; with an
  EAGLE-3 head the verifier ships the layers its config names, `--eagle-feature-layers`, and
  runs no Medusa heads); medusa is the verifier's `--medusa DIR`; ngram, suffix, mtp
  (deepseek_mtp) and draft_model are the methods of those names; no method with a model is
  draft_model, as in vLLM;
- `model`: the head's or draft model's directory;
- `num_speculative_tokens`: the k cap (`--max-spec-tokens`);
- `prompt_lookup_max` / `prompt_lookup_min`: `--max-ngram-size` / `--min-ngram-size` (one
  given stands for both, as in vLLM);
- `draft_tensor_parallel_size`: 1 only (a draft worker runs on one device).

A key outside these is an error naming it (and the keys understood), as is a method outside
the table. vLLM's flags of the same meaning are accepted beside Tandem's by each CLI
(`--max-model-len`, `--max-num-seqs`, `--[no-]enable-prefix-caching`,
`--num-speculative-tokens`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

METHODS = {"eagle": "eagle", "eagle3": "eagle", "medusa": "medusa", "ngram": "ngram",
           "suffix": "suffix", "draft_model": "draft_model", "mtp": "mtp",
           "deepseek_mtp": "mtp"}
KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
        "prompt_lookup_max", "prompt_lookup_min")
_NEEDS_MODEL = ("eagle", "eagle3", "medusa", "draft_model", "mtp", "deepseek_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # vLLM's name
    model: str = ""
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    @property
    def tandem_method(self) -> str:
        return METHODS[self.method]


def _int(data: dict, key: str, low: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"--speculative-config: {key} must be an integer >= {low}, got "
                         f"{value!r}")
    return value


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's --speculative-config JSON; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {', '.join(unknown)} (Tandem "
                         f"reads {', '.join(KEYS)})")
    method, model = data.get("method"), data.get("model") or ""
    if method is None and model:
        method = "draft_model"  # vLLM: a model without a method is a draft model
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not served (one of "
                         f"{', '.join(METHODS)})")
    if method in _NEEDS_MODEL and not model:
        raise ValueError(f"--speculative-config: method {method} needs a model (its "
                         "directory)")
    if not isinstance(model, str):
        raise ValueError(f"--speculative-config: model must be a path, got {model!r}")
    tp = data.get("draft_tensor_parallel_size")
    if tp not in (None, 1):
        raise ValueError(f"--speculative-config: draft_tensor_parallel_size {tp!r}: a draft "
                         "worker runs on one device (1)")
    spec = SpeculativeConfig(method, model, _int(data, "num_speculative_tokens", 1),
                             _int(data, "prompt_lookup_max", 1),
                             _int(data, "prompt_lookup_min", 1))
    lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"--speculative-config: prompt_lookup_min {lo} > prompt_lookup_max "
                         f"{hi}")
    return spec


def ngram_sizes(spec: SpeculativeConfig) -> tuple[int | None, int | None]:
    """(max, min) n-gram sizes; one given stands for both, as in vLLM."""
    hi, lo = spec.prompt_lookup_max, spec.prompt_lookup_min
    return (hi if hi is not None else lo), (lo if lo is not None else hi)


def eagle_feature_layers(head_dir: str) -> str:
    """The verifier's --eagle-feature-layers for the EAGLE head at head_dir: its config's
    layers for an EAGLE-3 head (or its default, eagle3), final for any other."""
    from tandem.engine.eagle3_published import is_eagle3, layer_ids_of

    if not is_eagle3(Path(head_dir)):
        return "final"
    ids = layer_ids_of(json.loads((Path(head_dir) / "config.json").read_text()))
    return ",".join(map(str, ids)) if ids else "eagle3"


def verifier_overrides(spec: SpeculativeConfig) -> dict:
    """The verifier's configuration fields (VerifierConfig's names) that mean `spec`."""
    out: dict = {}
    if spec.num_speculative_tokens is not None:
        out["max_spec_tokens"] = spec.num_speculative_tokens
    if spec.method == "medusa":
        out["medusa"] = spec.model
    if spec.tandem_method == "eagle":
        if spec.method == "eagle3" and not (Path(spec.model) / "config.json").is_file():
            raise ValueError(f"--speculative-config: method eagle3 reads the head's layers "
                             f"from {spec.model}/config.json, which is not here: give the "
                             "head's directory, or --eagle-feature-layers")
        out["eagle_feature_layers"] = eagle_feature_layers(spec.model)
        if out["eagle_feature_layers"] != "final":
            out["medusa"] = "off"  # Medusa heads read the final hidden state
    hi, lo = ngram_sizes(spec)
    if hi is not None:
        out.update(max_ngram_size=hi, min_ngram_size=lo)
    return out


def as_flags(fields: dict) -> list[str]:
    """Configuration fields as the command-line flags of the same names."""
    return [a for name, value in fields.items()
            for a in ("--" + name.replace("_", "-"), str(value))]


def add_vllm_aliases(p: argparse.ArgumentParser, k_dest: str = "max_spec_tokens") -> None:
    """vLLM's name of the k cap beside Tandem's (--max-spec-tokens)."""
    p.add_argument("--num-speculative-tokens", dest=k_dest, type=int,
                   default=argparse.SUPPRESS,
                   help="vLLM's name of --max-spec-tokens (the same flag)")


def add_speculative_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default="", metavar="JSON",
                   help="vLLM's speculative config, e.g. '{\"method\": \"eagle3\", \"model\": "
                        "DIR, \"num_speculative_tokens\": 5}': method eagle, eagle3, medusa, "
                        "ngram, suffix, mtp or draft_model; model; num_speculative_tokens (the "
                        "k cap); prompt_lookup_max/min (n-gram sizes); "
                        "draft_tensor_parallel_size 1. It sets those flags")


def up_overrides(spec: SpeculativeConfig) -> dict:
    """`tandem up`'s ClusterConfig fields for `spec`: the head or draft model, the flags of
    every verifier and draft worker, and the gateway's method preference."""
    out: dict = {"method_preference": spec.tandem_method}
    # an EAGLE head's feature layers (and --medusa off) come from the launcher's --eagle
    verifier = {k: v for k, v in verifier_overrides(spec).items()
                if k in ("max_spec_tokens", "max_ngram_size", "min_ngram_size")
                or (k == "medusa" and spec.method == "medusa")}
    drafts: list[str] = []
    if spec.tandem_method == "eagle":
        out["eagle"] = spec.model  # the launcher adds the layers an EAGLE-3 head reads
    elif spec.method == "draft_model":
        out["draft_model"] = spec.model
    elif spec.tandem_method == "mtp":
        drafts += ["--mtp", spec.model]
    if "max_ngram_size" in verifier:
        drafts += ["--max-ngram-size", str(verifier["max_ngram_size"])]
    out["verifier_args"] = tuple(as_flags(verifier))
    out["draft_args"] = tuple(drafts)
    return out
