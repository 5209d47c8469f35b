"""`tandem distill bundle` / `unbundle`: train an EAGLE head on a CUDA machine that has only
torch, transformers and safetensors (no tandem, no network), through size-limited uploads.

`bundle` writes a directory of files each at most --part-mib MiB: the stand-alone script
(tools/distill/airgap_train.py), bundle.json (what the script needs to know that only tandem
computes: the head's geometry, the target's rotary frequencies, stop and special ids) and
files/ (the target checkpoint, its tokenizer and the pre-tokenized prompts, big files split
into parts, with a manifest of sha256 per part and per file). `unbundle` checks and
reassembles the parts the script returns into a head directory `tandem draft --eagle` loads.
"""
from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tandem.models import DEFAULT_TARGET, ModelError

# The stand-alone script and the sibling modules it imports (torch, transformers, safetensors
# and the standard library only), copied into every bundle.
SCRIPTS = tuple(Path(__file__).with_name(f"airgap_{n}.py") for n in (
    "train", "parts", "data", "head", "head3", "fit", "prompts", "speculators"))
MAX_UPLOAD_MIB = 64


@dataclass(frozen=True)
class BundleConfig:
    out: Path
    target: str = DEFAULT_TARGET
    minutes: float = 10.0  # the script's default budget (generation + training)
    part_mib: float = 60.0  # every bundle file is at most this large
    prompts: int = 12000  # the chat set has about 12,000 distinct prompts
    # tools.distill.corpus.build_prompts' "chat" or "corpus", or "self": the script samples
    # the requests from the target first (tools/distill/airgap_prompts.py)
    mix: str = "chat"
    max_new_tokens: int = 160
    val_fraction: float = 0.04  # prompts (conversations) held out for validation
    seed: int = 0
    method: str = "eagle"  # the script's default head: eagle (EAGLE-1) or eagle3

    def __post_init__(self):
        if not 0 < self.part_mib <= MAX_UPLOAD_MIB:
            raise ValueError(f"--part-mib must be in (0, {MAX_UPLOAD_MIB}], got {self.part_mib}")
        if self.minutes <= 0 or self.prompts < 2 or self.max_new_tokens < 1:
            raise ValueError("need --minutes > 0, --prompts >= 2 and --max-new-tokens >= 1")
        if self.mix not in ("chat", "corpus", "self"):
            raise ValueError(f"--mix must be chat, corpus or self, got {self.mix!r}")
        if self.method not in ("eagle", "eagle3"):
            raise ValueError(f"--method must be eagle or eagle3, got {self.method!r}")
        if not 0 < self.val_fraction <= 0.5:
            raise ValueError(f"--val-fraction must be in (0, 0.5], got {self.val_fraction}")

    @property
    def part_bytes(self) -> int:
        return int(self.part_mib * (1 << 20))


def check_plain_llama(cfg) -> None:
    """The script's head is tools/distill/eagle_head.py's: one plain Llama layer."""
    odd = {"qkv_bias": cfg.qkv_bias, "attention_bias": cfg.o_bias, "qk_norm": cfg.qk_norm,
           "norm offset": cfg.norm_offset, "embedding scale": cfg.embed_scale != 1.0,
           "activation": cfg.activation != "silu", "sandwich norms": cfg.sandwich_norms,
           "query scale": cfg.query_scale, "soft-capping": cfg.attn_softcap or cfg.final_softcap,
           "sliding window": cfg.sliding_window}
    if bad := [k for k, v in odd.items() if v]:
        raise ModelError(f"the air-gapped trainer's head is a plain Llama layer; this target "
                         f"has {', '.join(bad)}")


def geometry(cfg) -> dict:
    """The target's widths the air-gapped heads are built from (bundle.json's geometry)."""
    return {"hidden": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size,
            "eps": cfg.rms_norm_eps, "layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
            "tie": cfg.tie_word_embeddings}


def _val_every(cfg: BundleConfig) -> int:
    return max(2, round(1 / cfg.val_fraction))


def _self_prompts_spec(tokenizer, cfg: BundleConfig) -> dict:
    """What the script needs to sample the requests itself (mix "self")."""
    from tools.distill.config import DataConfig
    from tools.distill.self_prompts import heldout_keys, query_prefix, turn_end_ids

    return {"prefix": query_prefix(tokenizer), "stop_ids": turn_end_ids(tokenizer),
            "count": cfg.prompts, "batch": min(64, cfg.prompts), "seed": cfg.seed,
            "val_every": _val_every(cfg), "max_ids": DataConfig.max_prompt_tokens,
            "heldout_keys": sorted(heldout_keys())}


def _write_prompts(tokenizer, cfg: BundleConfig, path: Path, log) -> int:
    """prompts.jsonl, pre-tokenized as tandem distill encodes them; every k-th prompt
    (k = 1 / val_fraction) is held out, so that any prefix a short run answers has some.
    Mix "self" writes none: the script samples them."""
    from tqdm import tqdm

    from tools.distill.config import DataConfig
    from tools.distill.corpus import build_prompts, encode_prompt

    if cfg.mix == "self":
        path.write_text("")
        log(f"bundle: the script samples {cfg.prompts} requests from the target")
        return 0
    prompts = build_prompts(cfg.prompts, cfg.seed, mix=cfg.mix)
    random.Random(cfg.seed).shuffle(prompts)
    every = _val_every(cfg)
    n_val = -(-len(prompts) // every)
    with open(path, "w") as f:
        for i, p in enumerate(tqdm(prompts, desc="tokenize prompts", file=sys.stderr)):
            ids = encode_prompt(tokenizer, p, DataConfig.max_prompt_tokens)
            f.write(json.dumps({"split": "train" if i % every else "val", "text": p.text,
                                "ids": ids}) + "\n")
    log(f"bundle: {len(prompts)} prompts, {n_val} held out")
    return n_val


def _spec(paths, tokenizer, cfg: BundleConfig, tok_files: list[str]) -> dict:
    from tandem.engine.checkpoint import LlamaConfig
    from tandem.engine.rope import rope_inv_freq
    from tandem.models import generation_eos_ids, read_hf_config, tokenizer_hash

    lcfg = LlamaConfig.from_hf(read_hf_config(paths))
    check_plain_llama(lcfg)
    stop = [t for t in (tokenizer.eos_token_id, *generation_eos_ids(paths)) if t is not None]
    if not stop:
        raise ModelError(f"{paths.root}: the tokenizer names no end-of-sequence token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    special = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id,
                           tokenizer.pad_token_id) if t is not None]
    return {"format": "tandem-airgap/1",
            "target": {"name": paths.root.name, "tokenizer_sha256": tokenizer_hash(paths)},
            "prompts": "prompts.jsonl", "tokenizer_files": tok_files,
            "stop_ids": list(dict.fromkeys(stop)), "pad_id": pad, "special_ids": special,
            "geometry": geometry(lcfg), "inv_freq": rope_inv_freq(lcfg).tolist(),
            "eagle3_layer_ids": _eagle3_layers(lcfg, cfg.method),
            "defaults": {"minutes": cfg.minutes, "max_new_tokens": cfg.max_new_tokens,
                         "method": cfg.method}}


def _eagle3_layers(lcfg, method: str) -> list[int] | None:
    """EAGLE-3's default layers of this target (None if it has too few for them)."""
    from tandem.engine.eagle3 import default_layer_ids

    if lcfg.num_layers < 5:
        if method == "eagle3":
            raise ModelError(f"--method eagle3 reads three target layers; this target has "
                             f"{lcfg.num_layers}")
        return None
    return list(default_layer_ids(lcfg.num_layers))


def bundle(cfg: BundleConfig, log=print, command: str = "") -> Path:
    """Write the bundle directory; every file in it is at most cfg.part_mib MiB."""
    from transformers import AutoTokenizer

    from tandem.models import resolve_model
    from tools.distill.airgap_parts import pack
    from tools.distill.pipeline import _TOKENIZER_FILES

    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: choose a new --out")
    paths = resolve_model(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
    tok_files = [n for n in _TOKENIZER_FILES if (paths.root / n).is_file()]
    spec = _spec(paths, tokenizer, cfg, tok_files)
    if cfg.mix == "self":
        spec["self_prompts"] = _self_prompts_spec(tokenizer, cfg)
    weights = sorted(paths.root.glob("*.safetensors")) + \
        sorted(paths.root.glob("*.safetensors.index.json"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / spec["prompts"]
        _write_prompts(tokenizer, cfg, prompts, log)
        files = [paths.root / "config.json", *weights, *(paths.root / n for n in tok_files),
                 prompts]
        log(f"bundle: hashing and splitting {sum(f.stat().st_size for f in files) >> 20} MiB")
        pack(files, out / "files", cfg.part_bytes)
    spec["created_by"] = command
    (out / "bundle.json").write_text(json.dumps(spec, indent=1))
    for script in SCRIPTS:
        shutil.copyfile(script, out / script.name)
    (out / "README.txt").write_text(_readme(cfg))
    too_big = [p for p in out.rglob("*") if p.is_file() and p.stat().st_size > cfg.part_bytes]
    if too_big:  # bundle.json (the rotary table) or the script itself
        raise ModelError(f"bundle files over --part-mib: {', '.join(map(str, too_big))}")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"bundle: {out} ({sum(1 for p in out.rglob('*') if p.is_file())} files, "
        f"{total / 2**20:.1f} MiB)")
    return out


def _readme(cfg: BundleConfig) -> str:
    return (f"Upload this directory (every file <= {cfg.part_mib:g} MiB), then on the CUDA "
            "machine (torch, transformers, safetensors):\n\n"
            f"    python airgap_train.py --device cuda --minutes {cfg.minutes:g} --out OUT\n\n"
            "Rerun the same command if it stops: it continues. Bring back every file of "
            "OUT/return (each <= 16 MiB) and run\n\n"
            "    tandem distill unbundle --head-dir RETURNED --out HEAD_DIR [--target TARGET]\n"
            "    tandem up --eagle HEAD_DIR\n\n"
            f"The script trains an {cfg.method} head unless --method says otherwise "
            "(eagle3: three target layers, written in the speculators format vLLM loads).\n")


def unbundle(returned: Path, out: Path, log=print, target: str = DEFAULT_TARGET) -> Path:
    """Check and reassemble the returned head parts into `out`, then load the head as the
    draft worker will (a clear error if it would not). An EAGLE-3 head embeds with `target`'s
    embedding, so it is loaded with it (and checked to be the head's target)."""
    from tandem.engine.eagle import EagleHead
    from tandem.engine.eagle3_published import is_eagle3, load_eagle3
    from tandem.models import ModelPaths, resolve_model, tokenizer_hash
    from tools.distill.airgap_head3 import EAGLE3_CARD
    from tools.distill.airgap_parts import BundleError, unpack

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: choose a new --out")
    try:
        unpack(Path(returned), out, log)
    except BundleError as exc:
        raise ModelError(str(exc)) from exc
    if is_eagle3(out):
        card = json.loads((out / EAGLE3_CARD).read_text())
        paths = resolve_model(target)
        if tokenizer_hash(paths) != card["target"]["tokenizer_sha256"]:
            raise ModelError(f"the head was trained on {card['target']['name']}, not on "
                             f"--target {target} (another tokenizer)")
        load_eagle3(out, paths)
    else:
        card = EagleHead.load(ModelPaths(out)).card
    log(f"unbundle: {card.get('format')} head for {card.get('target', {}).get('name')} in "
        f"{out}; figures {json.dumps(card.get('progress', {}))}")
    return out


def register(distill_parser) -> None:
    """`tandem distill bundle` and `tandem distill unbundle`."""
    sub = distill_parser.add_subparsers(dest="distill_command", metavar="{bundle,unbundle}",
                                        help="air-gapped training "
                                             "(docs/reference/airgap_training.md)")
    d = BundleConfig(Path("."))
    b = sub.add_parser("bundle", help="write a self-contained bundle that trains an EAGLE head "
                       "on a CUDA machine with only torch, transformers and safetensors",
                       description=__doc__.split("\n\n")[0])
    b.add_argument("--out", type=Path, required=True, help="bundle directory (new or empty)")
    b.add_argument("--target", default=os.environ.get("TANDEM_MODEL", d.target),
                   help="default name or HF checkpoint dir [%(default)s]")
    b.add_argument("--minutes", type=float, default=d.minutes,
                   help="the script's default budget, generation + training [%(default)s]")
    b.add_argument("--part-mib", type=float, default=d.part_mib,
                   help=f"largest bundle file, at most {MAX_UPLOAD_MIB} [%(default)s]")
    b.add_argument("--prompts", type=int, default=d.prompts,
                   help="prompts (the chat mix has about 12,000 distinct) [%(default)s]")
    b.add_argument("--mix", choices=("chat", "corpus", "self"), default=d.mix,
                   help="prompt set (tools/distill/corpus.py), or self: requests the target "
                        "writes itself, sampled on the CUDA machine [%(default)s]")
    b.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    b.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="prompts held out for validation [%(default)s]")
    b.add_argument("--seed", type=int, default=d.seed)
    b.add_argument("--method", choices=("eagle", "eagle3"), default=d.method,
                   help="the script's default head: EAGLE-1 on the final hidden state, or "
                        "EAGLE-3 on three target layers (docs/results/eagle3_training.md) "
                        "[%(default)s]")
    b.set_defaults(func=_cmd_bundle)
    u = sub.add_parser("unbundle", help="check and reassemble a returned head into a "
                       "directory for `tandem draft --eagle`")
    u.add_argument("--head-dir", type=Path, required=True,
                   help="the returned files (OUT/return of airgap_train.py)")
    u.add_argument("--out", type=Path, required=True, help="head directory (new or empty)")
    u.add_argument("--target", default=os.environ.get("TANDEM_MODEL", d.target),
                   help="the target an EAGLE-3 head embeds with [%(default)s]")
    u.set_defaults(func=_cmd_unbundle)


def _cmd_bundle(args) -> int:
    cfg = BundleConfig(args.out, args.target, args.minutes, args.part_mib, args.prompts,
                       args.mix, args.max_new_tokens, args.val_fraction, args.seed,
                       args.method)
    command = shlex.join(["tandem", *getattr(args, "argv", sys.argv[1:])])
    print(bundle(cfg, log=lambda m: print(m, file=sys.stderr), command=command))
    return 0


def _cmd_unbundle(args) -> int:
    print(unbundle(args.head_dir, args.out, log=lambda m: print(m, file=sys.stderr),
                   target=args.target))
    return 0
