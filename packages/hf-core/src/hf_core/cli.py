"""The ``hybridflow`` command line.

Exit codes of ``hybridflow run``, so a launcher or a shell script can tell what happened:

* 0: the run finished.
* 1: the run failed inside: a worker raised or was lost, or a checkpoint did not fit on its
  disk.  One paragraph names the role, rank, method and cause (or the disk's room against a
  checkpoint's size), the latest checkpoint and the command that resumes from it; the full
  tracebacks go to ``<run.output_dir>/error.log``.
* 2: a bad input (recipe, override, model folder, tokenizer, data, reward function,
  checkpoint), reported in one message naming the key and the file -- before any process
  starts and before anything is written to the run's output folder.
* 130: interrupted (Ctrl-C): one line naming the last checkpoint.

Parsing, ``--help`` and the checks of a recipe up to its tokenizer import neither torch,
tensordict nor Ray, so the command answers at once; what a command needs beyond that is
imported where it is used.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hf_core.data.cli import add_data_command
from hf_core.errors import CheckpointError, DiskFullError, HybridFlowError
from hf_core.planner.cli import add_plan_command

if TYPE_CHECKING:
    from hf_core.config import TrainerConfig
    from hf_core.config.layout import RunLayout
    from hf_core.runtime import WorkerError, WorkerLostError

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
ERROR_LOG = "error.log"


def _backends(_: argparse.Namespace) -> int:
    from hf_core.plugins import list_backends

    table = Table(title="HybridFlow plugins")
    for column in (
        "plugin",
        "distribution",
        "version",
        "training engines",
        "rollout engines",
        "protocols",
        "algorithms",
        "rewards / tools / environments",
    ):
        table.add_column(column)
    for info in list_backends():
        if info.error:
            table.add_row(
                info.plugin,
                info.distribution,
                info.version,
                f"[red]failed to import, skipped: {info.error}[/red]",
            )
            continue
        table.add_row(
            info.plugin,
            info.distribution,
            info.version,
            ", ".join(info.training_engines) or "-",
            ", ".join(info.rollout_engines) or "-",
            ", ".join(info.protocols) or "-",
            ", ".join(info.algorithms) or "-",
            ", ".join(info.rewards_and_agents) or "-",
        )
    Console(width=240).print(table)
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
    """Load and check everything, then train; worker failures and Ctrl-C become one message
    and an exit code (bad inputs propagate to :func:`main`, which reports them)."""
    import logging

    from hf_core.trainer.preflight import load_run_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config: TrainerConfig | None = None
    try:
        config, layout = load_run_config(args.recipe, args.overrides, resume=args.resume)
        return _train(config, layout, args)
    except KeyboardInterrupt:
        _say("interrupted", _interrupted_line(config, args), "bold yellow")
        return EXIT_INTERRUPTED


def _train(config: TrainerConfig, layout: RunLayout, args: argparse.Namespace) -> int:
    from hf_core.trainer.choice import trainer_class

    # resolved once, at load
    trainer = trainer_class(config)(config, resume=args.resume, layout=layout)
    try:
        trainer.fit()  # prints its own summary table
    except DiskFullError as exc:  # a fault of the machine, like a lost worker: not a bad input
        _say("error", _disk_full_paragraph(exc, config, args))
        return EXIT_FAILED
    except Exception as exc:
        failure = _worker_failure(exc)
        if failure is None:
            raise
        restarts = len(getattr(trainer, "restarts", ()))  # self-healing restarts before this
        _say("error", _failure_paragraph(failure, exc, config, args, restarts))
        return EXIT_FAILED
    return 0


def _worker_failure(exc: BaseException) -> WorkerError | WorkerLostError | None:
    """The :class:`WorkerError` / :class:`WorkerLostError` behind ``exc`` (itself or one it
    was raised from), if any: the trainer may wrap them, e.g. after giving up restarting."""
    from hf_core.runtime import WorkerError, WorkerLostError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, WorkerError | WorkerLostError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _failure_paragraph(
    failure: WorkerError | WorkerLostError,
    exc: BaseException,
    config: TrainerConfig,
    args: argparse.Namespace,
    restarts: int = 0,
) -> str:
    """Role, rank, method, cause; the latest checkpoint and how to resume; where the
    tracebacks are."""
    from hf_core.runtime import WorkerError

    if isinstance(failure, WorkerError):
        cause = f"{failure.exc_type}: {_first_line(failure.message)}"
        what = f"role {failure.role!r} rank {failure.rank} raised in {failure.method!r}"
    else:
        cause = _first_line(failure.reason)
        what = f"role {failure.role!r} rank {failure.rank} was lost during {failure.method!r}"
    out = Path(config.run.output_dir)
    after = f" (after {restarts} restart{'s' if restarts != 1 else ''})" if restarts else ""
    log = _write_error_log(out, failure, exc, args)
    logged = f"Full tracebacks: {log}." if isinstance(log, Path) else log
    return f"the run failed{after}: {what}: {cause}. {logged} {_resume_hint(out, args)}"


def _disk_full_paragraph(
    exc: DiskFullError, config: TrainerConfig, args: argparse.Namespace
) -> str:
    """The save's own message (sizes, what is intact), where the tracebacks are, the resume."""
    out = Path(config.run.output_dir)
    log = _write_error_log(out, exc.__cause__ or exc, exc, args)
    logged = f"Full tracebacks: {log}." if isinstance(log, Path) else log
    return f"the run failed: {exc}. {logged} {_resume_hint(out, args)}"


def _resume_hint(out: Path, args: argparse.Namespace) -> str:
    checkpoint = _latest_checkpoint(out)
    if checkpoint is None:
        return (
            f"No checkpoint was saved in {out}, so it starts over: {_command(args, resume=False)}"
        )
    return f"Latest checkpoint: {checkpoint}. Resume with: {_command(args, resume=True)}"


def _interrupted_line(config: TrainerConfig | None, args: argparse.Namespace) -> str:
    if config is None:
        return "before the run started; nothing was written"
    checkpoint = _latest_checkpoint(Path(config.run.output_dir))
    if checkpoint is None:
        return f"no checkpoint was saved in {config.run.output_dir}"
    return f"latest checkpoint: {checkpoint}; resume with: {_command(args, resume=True)}"


def _latest_checkpoint(out: Path) -> Path | None:
    from hf_core.trainer.checkpoint import latest_checkpoint

    try:
        return latest_checkpoint(out)
    except CheckpointError:
        return None


def _command(args: argparse.Namespace, *, resume: bool) -> str:
    """The command line as given (``--resume`` added or removed): what to run next."""
    words = [w for w in getattr(args, "argv", ["run"]) if w != "--resume"]
    return shlex.join(["hybridflow", *words, *(["--resume"] if resume else [])])


def _write_error_log(
    out: Path, failure: BaseException, exc: BaseException, args: argparse.Namespace
) -> Path | str:
    """Append the remote and driver tracebacks to ``out/error.log``; its path, or why not."""
    stacks = getattr(failure, "stacks_dir", None)
    lines = [
        f"=== hybridflow run failed at {datetime.now(UTC).isoformat()} ===",
        f"command: {_command(args, resume=args.resume)}",
        str(failure),  # a WorkerError's text carries the remote traceback
        *([f"every rank's Python stacks: {stacks}"] if stacks else []),
        "--- driver traceback ---",
        # the failure's own text is above; a wrapping exception shows the whole chain
        "".join(
            traceback.format_tb(exc.__traceback__)
            if exc is failure
            else traceback.format_exception(exc)
        ),
    ]
    path = out / ERROR_LOG
    try:
        out.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
    except OSError as err:
        return f"(could not write {path}: {err}; the remote traceback was: {failure})"
    return path


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _say(label: str, message: object, style: str = "bold red") -> None:
    """One message on stderr: styled label, plain text (no markup parsing, no wrapping, so a
    long path stays on one line and a bracket in a message prints as itself)."""
    text = "\n".join(line for line in str(message).splitlines() if line.strip())
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(Text.assemble((f"{label}: ", style), text))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow", description="HybridFlow: RLHF as a single-controller program."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser(
        "backends",
        help="list installed plugins, their versions and what each provides (engines, "
        "protocols, estimators, losses, rewards, tools), and those skipped",
    )
    backends.set_defaults(handler=_backends)
    add_plan_command(commands)
    add_data_command(commands)
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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; options and overrides of ``run`` may come in any order
    (``run recipe.yaml --resume k=v`` as well as ``run --resume recipe.yaml k=v``).

    argparse fills ``run``'s positionals in one go, so words after an option come back
    unrecognised; those that are not options are the rest of the overrides, in order.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(list(argv))
    if extra:
        options = [word for word in extra if word.startswith("-")]
        if args.command != "run" or options:
            parser.error(f"unrecognized arguments: {' '.join(options or extra)}")
        args.overrides = [*args.overrides, *extra]
    args.argv = list(argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        _say("interrupted", "stopped before the run started", "bold yellow")
        return EXIT_INTERRUPTED
    except Exception as exc:
        # imported here: the plugins load only for commands that need them
        from hf_core.plugins import PluginLoadError

        if isinstance(exc, PluginLoadError):
            _say("plugin error", exc)
        elif isinstance(exc, HybridFlowError | FileNotFoundError):
            _say("error", exc)
        else:
            raise
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
