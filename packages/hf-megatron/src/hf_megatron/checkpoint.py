"""Checkpoints: one file per rank (its parameters, optimiser shard, RNG) and a manifest.

The folder holds ``rank{r}.pt`` for every rank and ``meta.json``, written last (after a
barrier), so a folder without ``meta.json`` is an incomplete checkpoint.  A checkpoint resumes
only the layout that wrote it (same TP, PP and DP sizes and head); to change the layout,
export a HuggingFace folder (``export_hf``) and build the new engine from it.

A rank file holds only tensors, dicts, lists, tuples and plain values, and is read with
``weights_only=True``: a file whose pickle would build other objects (and could run code) is
refused as a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_core.atomic import load_tensor_file
from hf_core.errors import CheckpointError

if TYPE_CHECKING:
    from hf_megatron.engine import MegatronEngine

FORMAT = "hf-megatron-checkpoint/1"


def _layout(engine: MegatronEngine) -> dict[str, Any]:
    lay = engine.layout
    return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "world_size": engine.world_size}


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank{rank:05d}.pt"


def sub_optimizers(optimizer: Any) -> list[Any]:
    """megatron's optimizer is usually a ``ChainedOptimizer`` of per-group optimizers."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_state(engine: MegatronEngine) -> tuple[Any, Any]:
    subs = sub_optimizers(engine.optimizer)
    if not subs or not any(len(sub.optimizer.state) for sub in subs):
        return None, None  # frozen, or no step taken yet: nothing to keep
    states = [sub.state_dict() for sub in subs]
    params = None
    if engine.config.use_distributed_optimizer:
        params = [_mark_unpadded(sub.get_parameter_state_dp_reshardable()) for sub in subs]
    return states, params


def _mark_unpadded(state: dict[Any, Any]) -> dict[Any, Any]:
    """megatron-core 0.16's ``get_parameter_state_dp_reshardable`` omits the ``padding``
    flag its own ``load_parameter_state_from_dp_reshardable`` reads; every entry it returns
    is a real parameter, so mark them ``padding=False``."""
    for key, per_dtype in state.items():
        if not isinstance(key, int):
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return state


def _unshare_steps(inner: torch.optim.Optimizer) -> None:
    """megatron-core 0.16 (without Apex / Transformer Engine) restores torch Adam's ``step``
    as *one* tensor shared by every parameter's state; torch then increments it once per
    parameter each step, corrupting the bias correction.  Give each parameter its own."""
    for param_state in inner.state.values():
        if torch.is_tensor(param_state.get("step")):
            param_state["step"] = param_state["step"].clone()


def _rng_state(engine: MegatronEngine) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "cpu": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if engine.on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(path: str | Path, engine: MegatronEngine) -> None:
    """Every rank writes its file; rank 0 writes the manifest once all are done."""
    path = Path(path)
    rank = engine.rank
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / "meta.json").unlink(missing_ok=True)
    dist.barrier()
    optimizer, param_state = _optimizer_state(engine)
    state = {
        "format": FORMAT,
        "layout": _layout(engine),
        "coords": tuple(engine.layout.coords),
        "head": engine.config.head,
        "step": engine.step,
        # .cpu() copies from a GPU; on the CPU it is the parameter itself (torch.save writes
        # it before returning), so a save does not hold a second copy of the weights
        "model": {n: p.detach().cpu() for n, p in engine.module.named_parameters()},
        "optimizer": optimizer,
        "param_state": param_state,
        "rng": _rng_state(engine),
    }
    tmp = path / f".rank{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    tmp.rename(_rank_file(path, rank))
    dist.barrier()
    if rank == 0:
        meta = {
            "format": FORMAT,
            "head": engine.config.head,
            "step": engine.step,
            **_layout(engine),
        }
        (path / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()


@torch.no_grad()  # fp32 main params are views of the weights: copy into them without autograd
def load(path: str | Path, engine: MegatronEngine) -> int:
    """Restore what :func:`save` wrote; returns the step count."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete hf-megatron checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    want = _layout(engine)
    got = {k: meta.get(k) for k in want}
    if got != want or meta.get("head") != engine.config.head:
        raise CheckpointError(
            f"{path} was written by layout {got} head={meta.get('head')!r}; this engine is "
            f"{want} head={engine.config.head!r} (export_hf to change layouts)"
        )
    # mapped, not read: the state is copied into tensors the engine already holds, so
    # reading the file into memory first would hold the whole state twice
    state = load_tensor_file(_rank_file(path, engine.rank), map_location="cpu", mmap=True)
    if tuple(state["coords"]) != tuple(engine.layout.coords):
        raise CheckpointError(f"{path}: rank {engine.rank} file is for coords {state['coords']}")
    params = dict(engine.module.named_parameters())
    if {n: tuple(t.shape) for n, t in state["model"].items()} != {
        n: tuple(p.shape) for n, p in params.items()
    }:
        raise CheckpointError(f"{path}: parameter names or shapes differ from this model")
    for name, tensor in state["model"].items():
        params[name].copy_(tensor)
    if engine.optimizer is not None and state["optimizer"] is not None:
        subs = sub_optimizers(engine.optimizer)
        if len(subs) != len(state["optimizer"]):
            raise CheckpointError(
                f"{path}: optimizer has {len(subs)} parts, file has {len(state['optimizer'])}"
            )
        for i, sub in enumerate(subs):
            sub.load_state_dict(state["optimizer"][i])
            _unshare_steps(sub.optimizer)
            if state["param_state"] is not None:
                sub.load_parameter_state_from_dp_reshardable(state["param_state"][i])
    from megatron.core import tensor_parallel

    rng = state["rng"]
    torch.set_rng_state(rng["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    if engine.on_gpu and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    dist.barrier()
    return int(state["step"])
