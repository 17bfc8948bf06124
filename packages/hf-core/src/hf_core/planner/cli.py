"""``hybridflow plan RECIPE``: print the auto-mapping's best plans.

Kept here rather than in ``hf_core.cli`` so the mapping owns its command; the top-level CLI
wires it in with :func:`add_plan_command` and dispatches to :func:`run_plan`.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console

from hf_core.planner.devices import PROFILES
from hf_core.planner.plan import plan_to_placement
from hf_core.planner.recipe import load_recipe
from hf_core.planner.render import summary_table
from hf_core.planner.search import Planner


def add_plan_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``plan`` to a subparsers object; sets ``handler=run_plan`` on the parsed args."""
    parser = subparsers.add_parser(
        "plan",
        help="auto-map an RLHF dataflow onto a cluster (HybridFlow §6) and print the best plans",
        description=(
            "Search placements, device allocations and per-model parallel sizes with an "
            "analytical cost model; print the best plans."
        ),
    )
    parser.add_argument("recipe", help="plan recipe YAML (algorithm, models, workload, cluster)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides right after the recipe, e.g. workload.global_batch=512",
    )
    parser.add_argument(
        "--set",
        dest="set_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override anywhere on the line (repeatable)",
    )
    parser.add_argument("--nodes", type=int, help="number of nodes (overrides the recipe)")
    parser.add_argument("--devices-per-node", type=int, help="devices per node")
    parser.add_argument("--device", choices=sorted(PROFILES), help="device profile")
    parser.add_argument("--profile", help="measured profile JSON to calibrate the device with")
    parser.add_argument("--top", type=int, help="how many plans to print (default: recipe's top_k)")
    parser.add_argument(
        "--json", action="store_true", help="print the best plan as placement JSON for a runner"
    )
    parser.set_defaults(handler=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Plan and print; 0 on success, 2 with a one-line reason on bad input."""
    console = Console(width=max(Console().width, 150))
    try:
        overrides = [*(args.overrides or ()), *(getattr(args, "set_overrides", None) or ())]
        recipe = load_recipe(args.recipe, overrides)
        cluster = recipe.make_cluster(args.nodes, args.devices_per_node, args.device, args.profile)
        planner = Planner(recipe.dataflow(), recipe.model_specs(), recipe.workload, cluster)
        start = time.perf_counter()
        plans = planner.plan(top_k=args.top or recipe.top_k)
        elapsed = time.perf_counter() - start
    except ValueError as exc:
        Console(stderr=True).print(f"[bold red]plan error:[/] {exc}", highlight=False)
        return 2
    if args.json:
        print(json.dumps(plan_to_placement(plans[0]), indent=2))
        return 0
    console.print(summary_table(plans, title=f"{recipe.algorithm}: best plans"))
    for p in plans:
        console.print(p.render(), highlight=False)
    console.print(
        f"searched in {elapsed:.2f} s ({planner.candidate_cache.misses} model strategies, "
        f"{planner.pool_cache.misses} colocated sets costed)",
        style="dim",
    )
    return 0
