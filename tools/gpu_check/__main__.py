"""`python -m tools.gpu_check --out DIR`: `tandem gpu-check` without the rest of the CLI (for
a bare image: needs torch and numpy only)."""
from __future__ import annotations

import argparse
import sys

from tools.gpu_check.cli import add_arguments, cmd_gpu_check, description


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=description(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_gpu_check(args)
    except ValueError as exc:
        print(f"gpu-check: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
