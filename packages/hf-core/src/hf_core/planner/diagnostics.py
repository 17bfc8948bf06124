"""Error messages with numbers: why a model, or a whole dataflow, does not fit a cluster."""

from __future__ import annotations

from collections.abc import Sequence

from hf_core.planner.autoparallel import AXES, RoleModel, layouts
from hf_core.planner.devices import GIB, DeviceCluster
from hf_core.planner.memory import (
    generation_weight_bytes,
    infer_activation_bytes,
    kv_bytes_per_token,
    persistent_bytes,
    train_activation_bytes,
)
from hf_core.planner.workload import Workload
from hf_core.resharding import ParallelLayout


def footprint(rm: RoleModel, layout: ParallelLayout, workload: Workload) -> float:
    """Per-device bytes a model needs alone under one layout: resident state plus its largest
    transient (generation assumes ``t_g = t`` and one sequence of KV cache)."""
    wl, spec = workload, rm.spec
    need = persistent_bytes(spec, layout, rm.trained, wl.distributed_optimizer)
    transient = 0.0
    for _, op in rm.ops:
        if op.kind == "train":
            transient = max(transient, train_activation_bytes(spec, layout, wl))
        elif op.kind == "infer":
            transient = max(transient, infer_activation_bytes(spec, layout, wl))
        else:
            kv = kv_bytes_per_token(spec, layout.tp) * wl.sequence_length
            transient = max(transient, generation_weight_bytes(spec, layout, layout.tp) + kv)
    return need + transient


def too_big(rm: RoleModel, cluster: DeviceCluster, workload: Workload) -> str:
    """Why one model cannot run on the whole cluster, naming it and the memory needed vs had."""
    n, usable = cluster.num_devices, cluster.device.usable_bytes
    what = (
        "16 bytes/param for weights, gradients and Adam states"
        if rm.trained
        else "2 bytes/param for bf16 weights"
    )
    head = f"model {rm.role!r} ({rm.spec.name}, {rm.spec.num_params / 1e9:.1f}B parameters, {what})"
    have = (
        f"{n} x {cluster.device.name} with {usable / GIB:.1f} GiB usable each "
        f"({n * usable / GIB:.1f} GiB in total)"
    )
    if rm.state_bytes > n * usable:
        return f"{head} needs {rm.state_bytes / GIB:.1f} GiB but the cluster has {have}"
    shapes = layouts(rm.spec, n, cluster.devices_per_node, rm.parallelism)
    if not shapes:
        return (
            f"{head}: no (t, p, d) layout of {n} devices suits its shape "
            f"({rm.spec.num_heads} heads, {rm.spec.num_layers} layers) on "
            f"{cluster.devices_per_node}-device nodes{_limits(rm)}"
        )
    need, best = min(
        ((footprint(rm, lay, workload), lay) for lay in shapes), key=lambda item: item[0]
    )
    return (
        f"{head} needs at least {need / GIB:.1f} GiB per device (best layout "
        f"t={best.tp}, p={best.pp}, d={best.dp}{_limits(rm)}) with its activations"
        f"{' and KV cache' if rm.generates else ''}, but the cluster has {have}"
    )


def _limits(rm: RoleModel) -> str:
    """What the role's engine allows, when that (not the model) may rule layouts out."""
    par = rm.parallelism
    fixed = [f"{k}={v}" for k, v in (("t", par.tp), ("p", par.pp)) if v is not None]
    if par.axes == AXES and not fixed:
        return ""
    axes = ", ".join(sorted(par.axes)) or "none (data parallel only)"
    return f" with its engine's model-parallel axes: {axes}" + (
        f", fixed {' '.join(fixed)}" if fixed else ""
    )


def nothing_fits(roles: Sequence[RoleModel], cluster: DeviceCluster) -> str:
    """Why every model fits alone but no placement fits them all."""
    n, usable = cluster.num_devices, cluster.device.usable_bytes
    need = sum(r.state_bytes for r in roles)
    head = f"no placement of {[r.role for r in roles]} fits on {n} x {cluster.device.name}"
    if need > n * usable:
        return (
            f"{head}: their weights, gradients and optimizer states need {need / GIB:.1f} GiB "
            f"but the cluster has {n * usable / GIB:.1f} GiB usable"
        )
    return (
        f"{head}: their weights, gradients and optimizer states take {need / GIB:.1f} of the "
        f"{n * usable / GIB:.1f} GiB usable, leaving too little per device for activations, "
        f"the generation shard and KV cache under any placement and allocation"
    )
