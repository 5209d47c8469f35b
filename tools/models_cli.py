"""`tandem models`: fetch, locate, inspect and convert checkpoints."""
from __future__ import annotations

import sys

from tandem.models import DEFAULT_TARGET, OFFLINE_MODELS


def register_models(sub, add_model_args) -> None:
    """Add `models` and its sub-commands (`add_model_args`: the shared --model flags)."""
    models = sub.add_parser("models", help="fetch and locate model checkpoints")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="make an offline model (default: the default target, "
                            f"{DEFAULT_TARGET}) available and print its directory")
    fetch.add_argument("name", nargs="?", default=DEFAULT_TARGET,
                       help=f"one of {', '.join(OFFLINE_MODELS)} (default %(default)s)")
    fetch.add_argument("--force", action="store_true", help="convert again even if cached")
    fetch.set_defaults(func=_cmd_models_fetch)
    insp = msub.add_parser("inspect", help="say whether a checkpoint can be served, naming "
                           "the first feature Tandem cannot compute exactly if not")
    insp.add_argument("model", help="a local HF checkpoint directory (or the default name)")
    insp.set_defaults(func=_cmd_models_inspect)
    path = msub.add_parser("path", help="print the checkpoint directory a --model resolves to")
    add_model_args(path)
    path.set_defaults(func=_cmd_models_path)
    from tools.convert_head import register as register_convert_head

    register_convert_head(msub)


def _cmd_models_fetch(args) -> int:
    from tandem.models import fetch_model

    path = fetch_model(args.name, log=lambda m: print(m, file=sys.stderr), force=args.force)
    print(path)
    return 0


def _cmd_models_path(args) -> int:
    from tandem.models import resolve_model

    print(resolve_model(args.model).root)
    return 0


def _cmd_models_inspect(args) -> int:
    """Exit 0: servable; 1: well-formed but not servable; 2: not a readable checkpoint (a
    malformed or missing file), with one line on stderr and no traceback."""
    from safetensors import SafetensorError

    from tandem.engine.inspect import inspect
    from tandem.models import ModelError, resolve_model

    try:
        root = resolve_model(args.model).root
        _check_readable(root)
        ok, lines = inspect(root)
    except (ModelError, OSError, SafetensorError, ValueError, TypeError, KeyError) as exc:
        # TypeError/KeyError: a config.json field of the wrong type or missing
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        print(f"tandem models inspect: {args.model}: cannot read the checkpoint: {reason}",
              file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if ok else 1


def _check_readable(root) -> None:
    """Raise (ValueError, OSError or SafetensorError) unless config.json is a JSON object
    and every *.safetensors file's header and data are whole."""
    import json

    from safetensors import safe_open

    if not isinstance(json.loads((root / "config.json").read_text()), dict):
        raise ValueError("config.json is not a JSON object")
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt"):
            pass  # opening parses the header and checks that the data covers it
