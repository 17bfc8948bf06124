"""Rich tables for plans: one table per plan, and a one-row-per-plan summary."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table

from hf_core.planner.devices import GIB
from hf_core.planner.plan import Plan

_SHORT = {"generation": "gen", "preparation": "prep", "training": "train"}


def _stage(name: str) -> str:
    """Short column header for a stage."""
    return f"{_SHORT.get(name, name)} s"


def _seconds(value: float) -> str:
    """Seconds with a precision that suits their size; blank for zero."""
    return f"{value:.1f}" if value >= 10 else (f"{value:.2f}" if value > 0 else "-")


def plan_table(plan: Plan, title: str | None = None) -> Table:
    """Pools, each model's layout (train t/p/d, generation t_g), memory and stage seconds."""
    stages = list(plan.stage_seconds)
    table = Table(
        title=escape(title or f"{plan.algorithm}: {plan.describe()}"),
        caption=(
            f"{plan.iteration_seconds:.1f} s/iteration, {plan.tokens_per_second:,.0f} tokens/s "
            f"on {plan.cluster.num_devices} x {plan.cluster.device.name} "
            f"(reshard {plan.transition_seconds:.2f} s, inside generation)"
        ),
    )
    for column in ("pool", "devices", "role", "model", "t/p/d", "gen t_g", "GiB/dev"):
        table.add_column(column, justify="right" if column in ("devices", "GiB/dev") else "left")
    for stage in stages:
        table.add_column(_stage(stage), justify="right")
    for pool in plan.pools:
        for i, m in enumerate(pool.models):
            lay = m.layout
            table.add_row(
                pool.name if i == 0 else "",
                str(pool.devices) if i == 0 else "",
                m.role,
                m.model,
                f"{lay.tp}/{lay.pp}/{lay.dp}",
                str(m.generation.tp) if m.generation else "-",
                f"{pool.peak_bytes / GIB:.1f}" if i == 0 else "",
                *(_seconds(m.stage_seconds.get(s, 0.0)) for s in stages),
            )
        table.add_section()
    table.add_row(
        "iteration",
        str(plan.cluster.num_devices),
        "",
        "",
        "",
        "",
        "",
        *(_seconds(plan.stage_seconds[s]) for s in stages),
        style="bold",
    )
    return table


def summary_table(plans: Sequence[Plan], title: str = "auto-mapping: best plans") -> Table:
    """One row per plan, best first: placement, allocation and estimated seconds."""
    table = Table(title=escape(title))
    stages = list(plans[0].stage_seconds) if plans else []
    for column in ("#", "placement", *(_stage(s) for s in stages), "s/iter", "tokens/s"):
        table.add_column(column, justify="left" if column == "placement" else "right")
    for rank, plan in enumerate(plans, 1):
        table.add_row(
            str(rank),
            escape(plan.describe()),
            *(_seconds(plan.stage_seconds[s]) for s in stages),
            f"{plan.iteration_seconds:.1f}",
            f"{plan.tokens_per_second:,.0f}",
        )
    return table


def to_text(renderable: RenderableType, width: int = 140) -> str:
    """Render to plain text (docs, logs, tests) without terminal colours."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue()
