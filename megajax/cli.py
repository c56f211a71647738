"""The `megajax` command.

    megajax train [--config FILE ...] [key.sub=value ...]

A user error (bad config, mesh, file) prints one paragraph on stderr and
exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from megajax.errors import UserError

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _simulate_cpu_devices(count: int) -> None:
    """Asks XLA for `count` host devices, unless the caller already chose a count."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 0 and DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config (path, or a name under configs/ such as model/llama3-8b); "
                        "repeatable, later files override earlier ones")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=100 mesh.tensor=4")


def cmd_train(args: argparse.Namespace) -> int:
    from megajax.config import load_config
    cfg = load_config(args.config, args.overrides)
    _simulate_cpu_devices(cfg.mesh.cpu_devices)
    from megajax.train.loop import train
    train(cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megajax", description="Megatron-style LLM training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="train a model (no arguments: a small model on an embedded corpus)")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        message = re.sub(r"\s+", " ", str(e)).strip()
        print(f"megajax {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megajax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
