"""How long the ``hybridflow`` command takes to answer: help, and recipe errors caught before a run.

Each case runs the installed ``hybridflow`` script (the one beside this Python) in a fresh
process; the figure is the wall time of that process, median of ``--runs`` runs.  The recipe
cases use ``recipes/grpo.yaml`` with a model folder made here (a ``config.json`` and a
safetensors header, no weights: preflight reads only those) and one fault each: a data file
that does not exist, an unknown key, an unknown backend.  The missing data file is measured
twice: with the recipe's backends (the checks import each engine's settings model from its
plugin) and with the same recipe on a stub plugin, installed here, whose settings models
import only pydantic -- hf-core's own share.  Every run's exit code and message are checked,
so a case that stops failing the way it should is an error, not a fast figure.

One more run per case under ``python -X importtime`` sums up where the start-up goes: the
packages with the most cumulative import time (outside hf_core, whose total is the command's
own), and whether torch, tensordict or Ray were imported at all.

    python bench/cli_latency.py [--runs 5] [--bytecode-cache DIR] [--json out.json]
                                [--before before.json] [--write]

Without ``--bytecode-cache`` the children run as this environment does: with
``PYTHONDONTWRITEBYTECODE`` set and no ``__pycache__`` installed, every run compiles every module
it imports.  ``--bytecode-cache DIR`` lets them write and reuse compiled modules under ``DIR``
(``PYTHONPYCACHEPREFIX``), as an installed environment has them; each case then gets one
unmeasured run first.

Run it with the interpreter of an environment that has the backend plugins installed (the
recipe names ``fsdp`` and ``transformers``), e.g. ``.nox/e2e/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import publish, section

from hf_testing.plugin_packages import write_light_engine_plugin

TITLE = "## CLI start-up: help and recipe errors (`bench/cli_latency.py`)"
REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "grpo.yaml"
HEAVY = ("torch", "tensordict", "ray")
TOP_IMPORTS = 6


@dataclass(frozen=True)
class Case:
    """One command line and how it must end."""

    name: str
    args: tuple[str, ...]
    exit_code: int
    expect: str
    """Text the output must hold (the error the case is about)."""
    pythonpath: tuple[str, ...] = field(default=())
    """Folders put first on ``PYTHONPATH`` (the stub plugin's)."""


def stub_plugin(root: Path) -> Path:
    """A folder with the stub plugin installed: its package and a dist-info naming its entry
    point, as an installer leaves them."""
    return write_light_engine_plugin(root / "site", "hf_bench_stub")


def cases(model: Path, missing: Path, site: Path) -> list[Case]:
    recipe = ("run", str(RECIPE), f"model.path={model}", "data.val_files=[]")
    stub = ("actor.backend=stub-train", "reference.backend=stub-train")
    return [
        Case("hybridflow --help", ("--help",), 0, "usage: hybridflow"),
        Case("hybridflow run --help", ("run", "--help"), 0, "recipe fields"),
        Case(
            "run: missing data file",
            (*recipe, f"data.train_files=[{missing}]"),
            2,
            "data.train_files[0]",
        ),
        Case(
            "run: missing data file, stub backends",
            (*recipe, f"data.train_files=[{missing}]", *stub, "rollout.backend=stub-rollout"),
            2,
            "data.train_files[0]",
            (str(site),),
        ),
        Case("run: unknown key", (*recipe, "actor.lrr=1"), 2, "actor.lrr: unknown key"),
        Case(
            "run: unknown backend",
            (*recipe, "actor.backend=fsdpp"),
            2,
            "unknown training engine 'fsdpp'",
        ),
    ]


def model_folder(root: Path) -> Path:
    """A folder preflight accepts: a HF ``config.json`` and a safetensors file holding only a
    header (preflight reads the header, never the tensors)."""
    folder = root / "policy"
    folder.mkdir()
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 512,
    }
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


def command() -> list[str]:
    """The ``hybridflow`` console script of this environment (``-m hf_core.cli`` without one)."""
    script = Path(sys.executable).with_name("hybridflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hf_core.cli"]


def case_env(case: Case, env: dict[str, str]) -> dict[str, str]:
    path = [*case.pythonpath, *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path)} if path else env


def run_once(case: Case, env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [*command(), *case.args], capture_output=True, text=True, env=case_env(case, env), cwd=cwd
    )
    elapsed = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != case.exit_code or case.expect not in output:
        raise SystemExit(
            f"{case.name}: exit {done.returncode} (expected {case.exit_code}) and the output "
            f"does not hold {case.expect!r}:\n{output[-2000:]}"
        )
    return elapsed


def import_profile(case: Case, env: dict[str, str], cwd: Path) -> dict[str, object]:
    """``-X importtime`` of one run: total, the costliest top-level imports, heavy modules."""
    snippet = "import sys; from hf_core.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", snippet, *case.args],
        capture_output=True,
        text=True,
        env=case_env(case, env),
        cwd=cwd,
    )
    package_s: dict[str, float] = {}
    total = 0.0
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if not cumulative.strip().isdigit():
            continue  # the header line
        seconds = int(cumulative) / 1e6
        if not name[1:].startswith(" "):  # top level: imported by the command itself
            total += seconds
        root = name.strip().split(".")[0]
        package_s[root] = max(package_s.get(root, 0.0), seconds)  # its outermost import
    top = sorted(
        ((root, s) for root, s in package_s.items() if root != "hf_core"), key=lambda i: -i[1]
    )
    return {
        "imports_s": total,
        "top": top[:TOP_IMPORTS],
        "heavy": [name for name in HEAVY if name in package_s],
    }


def measure(runs: int, bytecode_cache: Path | None = None) -> dict[str, dict[str, object]]:
    env = dict(os.environ, COLUMNS="120")
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    if bytecode_cache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode_cache.resolve())
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, missing = model_folder(root), root / "no-such-prompts.jsonl"
        for case in cases(model, missing, stub_plugin(root)):
            if bytecode_cache is not None:
                run_once(case, env, root)  # compiles what the case imports, once
            times = [run_once(case, env, root) for _ in range(runs)]
            results[case.name] = {
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "runs": runs,
                **import_profile(case, env, root),
            }
            print(f"{case.name}: median {results[case.name]['median_s']:.2f} s", flush=True)
    return results


def _top_text(result: dict[str, object]) -> str:
    top = result["top"]
    assert isinstance(top, list)
    packages = ", ".join(f"{name} {seconds:.2f}" for name, seconds in top)
    return f"all imports {result['imports_s']:.2f}; {packages}"


def table(after: dict[str, dict[str, object]], before: dict[str, dict[str, object]] | None) -> str:
    head = "| case | median s | min-max s | heavy modules imported |"
    rule = "|---|---|---|---|"
    if before is not None:
        head = "| case | before: median s | before: heavy modules | " + head[len("| case | ") :]
        rule = "|---|---|---|---|---|---|"
    lines = [head, rule]
    for name, res in after.items():
        cells = [name]
        if before is not None:
            old = before.get(name)
            cells += (
                [f"{old['median_s']:.2f}", ", ".join(old["heavy"]) or "none"]  # type: ignore[arg-type]
                if old
                else ["-", "-"]
            )
        cells += [
            f"{res['median_s']:.2f}",
            f"{res['min_s']:.2f}-{res['max_s']:.2f}",
            ", ".join(res["heavy"]) or "none",  # type: ignore[arg-type]
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Import time, s (`-X importtime`, one run; a package's figure includes what it imports,"
        " so torch is counted inside whichever package imported it first):",
        "",
    ]
    for label, results in (("before", before), ("after", after)):
        if results is None:
            continue
        lines.append(f"{label}:")
        lines.append("")
        lines += [f"* {name}: {_top_text(res)}" for name, res in results.items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (median)")
    parser.add_argument(
        "--bytecode-cache", type=Path, help="write and reuse compiled modules in this folder"
    )
    parser.add_argument("--json", type=Path, help="also save the figures here")
    parser.add_argument("--before", type=Path, help="figures of an earlier tree (--json)")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    results = measure(args.runs, args.bytecode_cache)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    before = json.loads(args.before.read_text()) if args.before else None
    compiled = (
        "compiled modules cached (after one unmeasured run)"
        if args.bytecode_cache
        else "every module compiled on each run (no bytecode cache)"
    )
    description = (
        f"Wall time of a fresh `hybridflow` process, median of {args.runs} runs per case, "
        f"{compiled}; the recipe cases are `recipes/grpo.yaml` with a stub model folder and "
        "one fault each."
    )
    publish(TITLE, section(TITLE, description, table(results, before)), args.write)


if __name__ == "__main__":
    main()
