"""`tandem models convert-head SRC DST`: an EAGLE head into the speculators format (the one
vLLM loads and `tandem distill` now writes; tandem.engine.eagle_speculators reads it).

Converted exactly: EAGLE-3 heads in the published `midlayer.*` layout (SpecForge's and
SafeAILab's, and Tandem's own trainer output before the speculators format, with its
`tandem_eagle3.json` card, which is copied) and published EAGLE-1/2 heads (SafeAILab's
`cnets.py` layout: speculators' "eagle" type, no layernorms). A head of Tandem's private
EAGLE-1 format (`tandem_eagle.json`) has no speculators equivalent (its layer keeps an input
norm, a norm follows it, and it drafts over a truncated copy of the target's embedding rows):
it is refused with that reason and keeps being served as it is.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tools.distill.airgap_speculators import (
    LAYER_KEYS,
    SPECULATORS_VERSION,
    speculators_config,
    write_eagle3,
)

# No torch at import: `tandem --help` registers this command without it.
EAGLE_CARD = "tandem_eagle.json"  # tandem.engine.eagle.EAGLE_CARD
EAGLE3_CARD = "tandem_eagle3.json"  # tools.distill.airgap_head3.EAGLE3_CARD


def _verifier(src: Path, target: str) -> dict:
    """The speculators_config.verifier of the converted head: --target's, else the card's."""
    if target:
        from tandem.models import read_hf_config, resolve_model

        paths = resolve_model(target)
        return {"name_or_path": target,
                "architectures": read_hf_config(paths).get("architectures") or []}
    for card in (EAGLE3_CARD, EAGLE_CARD):
        try:
            name = json.loads((src / card).read_text()).get("target", {}).get("name")
        except (OSError, ValueError, AttributeError):
            continue
        if name:
            return {"name_or_path": name, "architectures": []}
    return {"name_or_path": None, "architectures": []}


def convert_head(src: Path, dst: Path, target: str = "", log=print) -> Path:
    """Write the head at src into dst (new or empty) in the speculators format."""
    from tandem.engine.eagle3_published import is_eagle3, layer_ids_of
    from tandem.engine.eagle_published import _read_weights, is_published_eagle
    from tandem.engine.eagle_speculators import speculators_type
    from tandem.models import ModelError

    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ModelError(f"{dst} is not empty: choose a new destination")
    if speculators_type(src):
        raise ModelError(f"{src} is already in the speculators format")
    if (src / EAGLE_CARD).is_file():
        raise ModelError(
            f"{src} is a head of Tandem's private EAGLE-1 format ({EAGLE_CARD}): the "
            "speculators format has no place for its layer's input norm, its output norm or "
            "its truncated tied vocabulary, so it cannot be converted exactly; it is still "
            "served as it is (`tandem draft --eagle DIR`). Train an EAGLE-3 head (`tandem "
            "distill --method eagle3`) for a head vLLM can load too")
    config = json.loads((src / "config.json").read_text())
    verifier = _verifier(src, target)
    if is_eagle3(src):
        ids = layer_ids_of(config)
        out = speculators_config(
            config, int(config.get("draft_vocab_size") or 0), [i + 1 for i in ids or ()],
            verifier, norm_before_residual=bool(config.get("norm_before_residual")))
        if ids is None:  # the verifier's default layers: vLLM's default too
            out.pop("eagle_aux_hidden_state_layer_ids")
        weights = _read_weights(src)
        out["draft_vocab_size"] = int(weights["lm_head.weight"].shape[0])
        write_eagle3(dst, out, weights)
        if (src / EAGLE3_CARD).is_file():
            shutil.copy(src / EAGLE3_CARD, dst / EAGLE3_CARD)
        log(f"convert-head: EAGLE-3 head {src} -> {dst} (speculators eagle3, layer ids "
            f"{out.get('eagle_aux_hidden_state_layer_ids', 'default')} in vLLM's reading)")
    elif is_published_eagle(src):
        _write_eagle1(src, dst, config, verifier)
        log(f"convert-head: EAGLE-1/2 head {src} -> {dst} (speculators eagle)")
    else:
        raise ModelError(f"{src} is no EAGLE head this converter knows (no config.json with "
                         "weights beside it)")
    return dst


def _write_eagle1(src: Path, dst: Path, config: dict, verifier: dict) -> None:
    from safetensors.torch import save_file

    from tandem.engine.eagle_published import _read_weights
    from tandem.engine.eagle_speculators import EAGLE1_PREFIXES, renamed

    weights = {name: t.contiguous() for name, t in renamed(
        _read_weights(src), [(b, a) for a, b in EAGLE1_PREFIXES]).items()}
    layer = {k: config[k] for k in LAYER_KEYS if config.get(k) is not None}
    layer.update(model_type="llama", num_hidden_layers=1)
    out = {"architectures": ["EagleSpeculator"], "speculators_model_type": "eagle",
           "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
           "layernorms": False, "fusion_bias": "fusion_fc.bias" in weights,
           "speculators_config": {
               "algorithm": "eagle", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
               "verifier": verifier}}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(out, indent=2))


def register(models_sub) -> None:
    """`tandem models convert-head`."""
    p = models_sub.add_parser("convert-head", help="write an EAGLE head (published EAGLE-3 "
                              "midlayer layout, Tandem's EAGLE-3 trainer output, published "
                              "EAGLE-1/2) in the speculators format vLLM loads")
    p.add_argument("src", help="the head's directory")
    p.add_argument("dst", help="a new directory for the converted head")
    p.add_argument("--target", default="", help="the target (a name or checkpoint dir) "
                   "recorded as the head's verifier (default: the head card's)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import sys

    from tandem.models import ModelError

    try:
        convert_head(Path(args.src), Path(args.dst), args.target,
                     log=lambda m: print(m, file=sys.stderr))
    except (ModelError, OSError, ValueError, KeyError) as exc:
        print(f"tandem models convert-head: {exc}", file=sys.stderr)
        return 2
    print(args.dst)
    return 0
