"""Command-line flags that also read an environment variable: one helper for every CLI.

`add_flag(parser, "--port", "TANDEM_VERIFIER_PORT", 50051, int, "port to bind")` gives
`--port`, defaulting to $TANDEM_VERIFIER_PORT or 50051, with both named in --help. The
environment's string goes through argparse's own `type` conversion, so a bad value is the same
clean usage error as a bad flag.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env(name: str, default: Any = None) -> Any:
    """$name if set and non-empty, else default."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def boolean(value: str | bool) -> bool:
    """An on/off flag's value: 1/0, true/false, yes/no, on/off (argparse `type`)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off (1/0, true/false, yes/no), got {value!r}")


def csv(value: str | None) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def add_flag(parser: argparse.ArgumentParser, flag: str, env_name: str, default: Any = None,
             type: Callable[[str], Any] | None = None, help: str = "", **kwargs) -> None:
    """Add `flag` whose default is $env_name (converted by `type`), else `default`."""
    shown = "" if default is None or default == "" else f", default {default}"
    parser.add_argument(flag, default=env(env_name, default), type=type,
                        help=f"{help} [env {env_name}{shown}]".strip(), **kwargs)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(value: str) -> str:
    """A logging level name in any case ('INFO', 'info') -> lower case (argparse `type`)."""
    word = value.strip().lower()
    word = "warning" if word == "warn" else word
    if word not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), "
                                         f"got {value!r}")
    return word


def add_log_level_flag(parser: argparse.ArgumentParser, service_env: str = "") -> None:
    """--log-level from $service_env, else $TANDEM_LOG_LEVEL (one setting for every service,
    e.g. from a shared ConfigMap), else info."""
    names = [n for n in (service_env, "TANDEM_LOG_LEVEL") if n]
    value = next((env(n) for n in names if env(n) is not None), "info")
    parser.add_argument("--log-level", default=value, type=log_level, metavar="LEVEL",
                        help=f"logging level: {', '.join(LOG_LEVELS)}, any case "
                             f"[env {' or '.join(names)}, default info]")
