"""The ``hybridflow`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hf_core.config import ConfigError
from hf_core.data import DataError
from hf_core.planner.cli import add_plan_command
from hf_core.plugins import PluginLoadError, list_backends
from hf_core.rewards import RewardFunctionError


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


def _fields_epilog() -> str:
    from hf_core.config import TrainerConfig, describe_fields

    rows = describe_fields(TrainerConfig)
    width = max(len(key) for key, _, _ in rows)
    lines = ["recipe fields (set in the YAML or override as key=value):"]
    for key, default, description in rows:
        lines.append(f"  {key:<{width}}  {default:<14} {description}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    import logging

    from hf_core.trainer import RLTrainer
    from hf_core.trainer.preflight import load_run_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_run_config(args.recipe, args.overrides)
    RLTrainer(config, resume=args.resume).fit()  # prints its own summary table
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
    run = commands.add_parser(
        "run",
        help="train with a recipe YAML and key=value overrides",
        description="Run an RL recipe: hybridflow run recipes/grpo.yaml actor.engine.lr=1e-5",
        epilog=_fields_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("recipe", help="recipe YAML file")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8")
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    run.set_defaults(handler=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except PluginLoadError as exc:
        Console(stderr=True).print(Text.assemble(("plugin error: ", "bold red"), str(exc)))
        return 2
    except (ConfigError, DataError, FileNotFoundError, RewardFunctionError) as exc:
        Console(stderr=True).print(Text.assemble(("error: ", "bold red"), str(exc)))
        return 2


if __name__ == "__main__":
    sys.exit(main())
