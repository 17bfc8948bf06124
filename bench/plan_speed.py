"""Auto-mapping benchmark: how long planning takes, and what it picks in the paper's setting.

    python bench/plan_speed.py            # timings + the docs table (markdown)
    python bench/plan_speed.py --timing   # timings only
    python bench/plan_speed.py --table    # the docs/auto_mapping.md table only

Timings use a fresh ``Planner`` (cold caches) per run.  The table is the paper's §8.1 setting:
PPO, Llama-2 7B/13B, CodeLlama 34B, Llama-2 70B for all four models, 16-128 A100-80G (8 per
node, 200 Gb/s between nodes), prompt and response length 1024, global batch 1024.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from hf_core.planner import Plan, Planner, make_cluster

ROLES = ("actor", "critic", "reference", "reward")
SIZES = ("llama2-7b", "llama2-13b", "codellama-34b", "llama2-70b")
DEVICES = (16, 32, 64, 128)
PAPER_NETWORK = {"inter_node_bandwidth_gbs": 25.0}  # 200 Gb/s per machine (§8.1)
BASELINES = {
    "colocate": [ROLES],
    "split": [("actor", "reference"), ("critic", "reward")],
    "standalone": [(r,) for r in ROLES],
}
"""The paper's hand-made placements (§8.4); split puts actor+reference and critic+reward
on separate halves, as OpenRLHF and NeMo-Aligner do."""


def _planner(
    algorithm: str, roles: tuple[str, ...], size: str, devices: int, **over: float
) -> Planner:
    cluster = make_cluster(devices // 8, 8, "a100-80g", overrides={**PAPER_NETWORK, **over})
    return Planner(algorithm, dict.fromkeys(roles, size), {}, cluster)


def timings(repeats: int = 3) -> list[str]:
    """Wall time of a full search (all placements) on 128 devices, cold caches."""
    cases = [("ppo", ROLES, size) for size in SIZES]
    cases.append(("safe-rlhf", (*ROLES, "cost"), "llama2-7b"))
    lines = [
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; {repeats} runs each, cold caches",
        "",
        "| algorithm | models | devices | placements | allocations scored | sets costed | "
        "model strategies costed | median s | max s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, roles, size in cases:
        runs, planner = [], None
        for _ in range(repeats):
            planner = _planner(algorithm, roles, size, 128)
            start = time.perf_counter()
            plans = planner.plan(top_k=100)
            runs.append(time.perf_counter() - start)
        assert planner is not None
        lines.append(
            f"| {algorithm} | {len(roles)} x {size} | 128 | {len(plans)} | "
            f"{planner.allocations_scored} | {planner.pool_cache.misses} | "
            f"{planner.candidate_cache.misses} | "
            f"{statistics.median(runs):.2f} | {max(runs):.2f} |"
        )
    return lines


SHORT = {"actor": "A", "critic": "C", "reference": "Ref", "reward": "RM", "cost": "Cost"}


def short(plan: Plan) -> str:
    """Compact placement for a table cell: ``split {A,Ref}:64 {C,RM}:64``."""
    pools = " ".join(
        "{" + ",".join(SHORT[r] for r in p.roles) + f"}}:{p.devices}" for p in plan.pools
    )
    return f"{plan.kind} {pools}"


def _actor(plan: Plan) -> str:
    """The actor's training layout and generation TP size."""
    actor = plan.models["actor"]
    lay, gen = actor.layout, actor.generation
    return f"{lay.tp}/{lay.pp}/{lay.dp}, {gen.tp if gen else '-'}"


def _best(planner: Planner, placement=None) -> tuple[str, float] | None:
    try:
        p = planner.plan(top_k=1, placements=None if placement is None else [placement])[0]
    except ValueError:
        return None
    return short(p), p.iteration_seconds


def _cell(result: tuple[str, float] | None, best: float | None) -> str:
    if result is None:
        return "does not fit"
    mark = " **(best)**" if best is not None and abs(result[1] - best) < 1e-9 else ""
    return f"{result[1]:.1f}{mark}"


def table() -> list[str]:
    """Planner's choice per model size and cluster size, beside the hand-made placements."""
    lines = [
        "| model | GPUs | auto-mapping choice (pool:GPUs) | actor t/p/d, t_g | s/iter | colocate | "
        "split | standalone | choice with op_overhead_s=2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for size in SIZES:
        for devices in DEVICES:
            planner = _planner("ppo", ROLES, size, devices)
            try:
                best = planner.plan(top_k=1)[0]
            except ValueError as exc:
                who = "the actor alone" if str(exc).startswith("model ") else "all four together"
                lines.append(
                    f"| {size} | {devices} | does not fit ({who}) | - | - | - | - | - | - |"
                )
                notes.append(f"- {size} on {devices} GPUs: {exc}")
                continue
            cells = [_cell(_best(planner, pl), best.iteration_seconds) for pl in BASELINES.values()]
            slow = _best(_planner("ppo", ROLES, size, devices, op_overhead_s=2.0))
            slow_text = f"{slow[0]} ({slow[1]:.1f})" if slow else "does not fit"
            lines.append(
                f"| {size} | {devices} | {short(best)} | {_actor(best)} | "
                f"{best.iteration_seconds:.1f} | " + " | ".join(cells) + f" | {slow_text} |"
            )
    return [*lines, "", *notes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true", help="timings only")
    parser.add_argument("--table", action="store_true", help="docs table only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    both = not (args.timing or args.table)
    if args.timing or both:
        print("\n".join(timings(args.repeats)))
    if both:
        print()
    if args.table or both:
        print("\n".join(table()))


if __name__ == "__main__":
    main()
