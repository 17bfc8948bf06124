"""GPU-only test support: skipping ``gpu``-marked tests without CUDA, torchrun jobs.

A GPU test runs its engine under torchrun in fresh processes (nccl needs its own process
group; CPU tests of the same session may already have made a gloo one).  The job script
writes one ``rank{r}.pt`` dict per rank; the test asserts on those dicts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch


def skip_gpu_items(items: list[pytest.Item], reason: str) -> None:
    """Skip every ``gpu``-marked item when this machine has no CUDA device.

    Call it from a conftest's ``pytest_collection_modifyitems``; ``reason`` says what the
    package's GPU tests need.
    """
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ the test side


def torchrun_job_fixture(script: Path) -> Any:
    """A module-scoped ``gpu_job`` fixture: ``script`` run on the ``llama`` tiny model."""

    @pytest.fixture(scope="module", name="gpu_job")
    def gpu_job(
        models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
    ) -> list[dict[str, Any]]:
        return run_torchrun_job(script, models["llama"], tmp_path_factory.mktemp("gpu_job"))

    return gpu_job


def run_torchrun_job(script: Path, model_path: Path, out_dir: Path) -> list[dict[str, Any]]:
    """Run ``script MODEL_DIR OUT_DIR`` on up to two GPUs; returns each rank's result dict."""
    world = min(2, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    cmd += [str(script), str(model_path), str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]


def assert_bf16_log_probs(result: Mapping[str, Any], model_path: Path) -> None:
    """The job's log-probs are close to the fp32 HF model's, yet not bit-equal (so they were
    computed in bf16), and its training step's gradient norm is finite."""
    from hf_testing.conformance.reference import hf_causal_lm, hf_log_probs_and_entropy

    batch = result["batch"]
    expected, _ = hf_log_probs_and_entropy(hf_causal_lm(model_path), batch, 1.0)
    diff = ((result["log_probs"].cpu() - expected) * batch["response_mask"]).abs()
    assert float(diff.mean()) < 0.05  # close to fp32 ...
    assert float(diff.max()) > 1e-6  # ... but computed in bf16, not fp32
    assert torch.isfinite(torch.tensor(result["metrics"]["grad_norm"]))


def assert_offload_round_trip(result: Mapping[str, Any]) -> None:
    """What :func:`offload_round_trip` recorded: offload frees most of the GPU memory the
    engine added (``mem_before_engine``, see :func:`start_nccl_job`), a forward pass
    while offloaded is refused, onload restores the memory and training goes on.  The bytes
    the engine reports are the memory that really left (within a factor of two either way:
    allocator rounding, FSDP's padded shards), a second offload reports 0, and onload
    reports what offload did."""
    base = result["mem_before_engine"]
    left, trained = result["mem_offloaded"] - base, result["mem_trained"] - base
    assert left < 0.5 * trained, (left, trained, result["live_after_offload"])
    freed = result["mem_trained"] - result["mem_offloaded"]
    moved = result["offload_bytes"]
    assert type(moved) is int and 0.5 * freed <= moved <= 2 * freed, (moved, freed)
    assert result["offload_again_bytes"] == 0
    assert result["onload_bytes"] == moved
    assert "offloaded; call onload() first" in result["offloaded_error"]
    assert result["mem_onloaded"] >= 0.9 * result["mem_trained"]
    assert result["metrics_after_onload"]["update_skipped"] == 0.0


# ------------------------------------------------------------------ the job side


def start_nccl_job() -> tuple[int, int, dict[str, Any]]:
    """In a torchrun process: pin the local GPU, join the nccl group.

    Returns ``(rank, world, results)`` with ``results`` holding the backend, the world size
    and ``mem_before_engine``: device memory allocated once the process's own fixed costs
    exist (a collective's and the matrix libraries' workspaces, made by a warm-up here), so
    an offload is judged on the memory the engine added.
    """
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    for dtype in (torch.float32, torch.bfloat16):
        warm = torch.ones(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        (warm @ warm).sum().backward()
    dist.all_reduce(torch.ones(1, device="cuda"))
    del warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    return rank, world, {"backend": dist.get_backend(), "world": world, "mem_before_engine": before}


def live_cuda_tensors(limit: int = 8) -> list[str]:
    """The largest CUDA storages still referenced, with a tensor that uses each: what an
    offload left on the device (for the failure message)."""
    import gc

    storages: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if not (torch.is_tensor(obj) and obj.is_cuda):
                continue
            storage = obj.untyped_storage()
            if storage.nbytes():
                what = f"{type(obj).__name__}{tuple(obj.shape)} {obj.dtype}"
                storages[storage.data_ptr()] = (storage.nbytes(), what)
        except (RuntimeError, ReferenceError):  # a tensor without storage, a dead proxy
            continue
    largest = sorted(storages.values(), reverse=True)[:limit]
    return [f"{what}: {nbytes} bytes" for nbytes, what in largest]


def offload_round_trip(
    engine: Any,
    batch: Any,
    loss_fn: Callable[..., Any],
    while_offloaded: Callable[[], Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Offload a trained engine, try a forward pass, onload and train again; records GPU
    memory at each point and the bytes offload / onload report.  ``while_offloaded`` adds
    what a backend checks in between."""
    torch.cuda.synchronize()
    out: dict[str, Any] = {"mem_trained": torch.cuda.memory_allocated()}
    out["offload_bytes"] = engine.offload()
    out["mem_offloaded"] = torch.cuda.memory_allocated()
    out["live_after_offload"] = live_cuda_tensors()
    out["offload_again_bytes"] = engine.offload()
    if while_offloaded is not None:
        out.update(while_offloaded())
    try:
        engine.compute_log_probs(batch)
        out["offloaded_error"] = None
    except RuntimeError as exc:
        out["offloaded_error"] = str(exc)
    out["onload_bytes"] = engine.onload()
    out["mem_onloaded"] = torch.cuda.memory_allocated()
    out["metrics_after_onload"] = engine.train_step(batch, loss_fn)
    return out


def _plain(value: Any) -> Any:
    """``value`` with every :class:`~hf_core.batch.Batch` turned into a dict of its tensors,
    so the test side reads the results with ``weights_only=True``."""
    from hf_core.batch import Batch

    if isinstance(value, Batch):
        return {key: value.tensors[key] for key in value.tensors.keys()}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def finish_nccl_job(results: Mapping[str, Any], out_dir: str, rank: int) -> None:
    """Write this rank's ``rank{r}.pt`` and leave the process group."""
    import torch.distributed as dist

    torch.save(_plain(results), Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
