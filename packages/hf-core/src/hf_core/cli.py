"""The ``hybridflow`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from hf_core.mapping.cli import add_plan_command
from hf_core.plugins import PluginLoadError, list_backends


def _backends(_: argparse.Namespace) -> int:
    table = Table(title="HybridFlow backends")
    for column in (
        "plugin",
        "distribution",
        "version",
        "training engines",
        "rollout engines",
        "protocols",
    ):
        table.add_column(column)
    for info in list_backends():
        table.add_row(
            info.plugin,
            info.distribution,
            info.version,
            ", ".join(info.training_engines) or "-",
            ", ".join(info.rollout_engines) or "-",
            ", ".join(info.protocols) or "-",
        )
    Console(width=200).print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow", description="HybridFlow: RLHF as a single-controller program."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser(
        "backends", help="list installed backends, their versions and the engines they provide"
    )
    backends.set_defaults(handler=_backends)
    add_plan_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except PluginLoadError as exc:
        Console(stderr=True).print(f"[bold red]plugin error:[/] {exc}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
