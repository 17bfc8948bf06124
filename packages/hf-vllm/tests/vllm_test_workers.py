"""A test worker hosting the hybrid engine pieces on each rank: an FSDP actor, the vLLM engine
and (as the reference for batch conventions) the HF rollout engine.

Importable by the Ray worker processes (the tests folder is put on their PYTHONPATH).  It is
also a sketch of what core's actor worker does with a vLLM rollout engine: build the training
engine first, then the rollout engine, report the generation mesh, stream weights after each
update.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_core.batch import Batch
from hf_core.engines import NamedTensor, SamplingParams
from hf_core.protocols import register
from hf_core.worker import Worker
from hf_testing.workers import with_generation_rank


def policy_loss(outputs: Mapping[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict]:
    """Plain policy gradient, token mean over the global batch (enough to move the weights)."""
    mask = mb["response_mask"].float()
    per_token = -outputs["log_probs"] * mb["advantages"]
    scale = mb.meta["dp_size"] / mb.meta["global_response_tokens"]
    return (per_token * mask).sum() * scale, {}


def perturbed(stream: Iterator[list[NamedTensor]], scale: float) -> Iterator[list[NamedTensor]]:
    """The same buckets with seeded noise added (identical on every rank, per tensor name)."""
    for bucket in stream:
        out = []
        for name, tensor in bucket:
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
            out.append((name, tensor + scale * noise))
        yield out


@contextmanager
def hybrid_group(
    name: str, model_path: Path, actor: dict[str, Any], vllm: dict[str, Any], hf: bool = False
) -> Iterator[Any]:
    """Two ranks of :class:`HybridWorker`, each with an FSDP actor (``actor`` settings), the
    vLLM engine (``vllm`` settings; ``group.info`` holds what ``build_vllm`` reported) and,
    with ``hf``, the HF rollout engine, all on ``model_path``."""
    from hf_core.runtime import ResourcePool, spawn

    pool = ResourcePool([2], name=name)
    workers = spawn(pool, {"hybrid": HybridWorker})["hybrid"]
    path = str(model_path)
    workers.build_actor({"model_path": path, **actor})
    if hf:
        workers.build_hf({"model_path": path})
    workers.info = workers.build_vllm({"model_path": path, **vllm})
    try:
        yield workers
    finally:
        workers.shutdown()
        pool.release()


def _process_state() -> tuple[Any, ...]:
    return (
        torch.random.get_rng_state(),
        np.random.get_state()[1].copy(),
        random.getstate(),
        torch.get_num_threads(),
    )


class HybridWorker(Worker):
    """FSDP actor + vLLM rollout (+ HF rollout) in one process per rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)  # two ranks share two cores; vLLM must keep this setting
        self.actor: Any = None
        self.rollouts: dict[str, Any] = {}

    # ----------------------------------------------------------------- building
    @register("ONE_TO_ALL")
    def build_actor(self, config: dict[str, Any]) -> None:
        from hf_fsdp.engine import FSDPEngine

        self.actor = FSDPEngine(config)

    @register("ONE_TO_ALL")
    def build_vllm(self, config: dict[str, Any]) -> dict[str, Any]:
        """Build the engine; report its layout and whether the process state survived."""
        from hf_vllm.engine import VLLMRolloutEngine

        torch.manual_seed(1234)
        before = _process_state()
        engine = VLLMRolloutEngine(config)
        after = _process_state()
        torch.set_num_threads(3)  # must still work after vLLM's CPU worker patched it
        threads_settable = torch.get_num_threads() == 3
        torch.set_num_threads(1)
        self.rollouts["vllm"] = engine
        layout = engine.generation_rank()
        self.set_mesh(with_generation_rank(self.mesh, layout))
        from hf_vllm.cpu_shm import SHM_DIR

        return {
            "layout": (layout.dp_rank, layout.dp_size, layout.tp_rank, layout.tp_size),
            "shm_left": sorted(p.name for p in SHM_DIR.glob("hfvllm*cpushm*")),
            "executor": engine.executor,
            "startup_seconds": engine.startup_seconds,
            "torch_rng_kept": torch.equal(before[0], after[0]),
            "numpy_rng_kept": bool((before[1] == after[1]).all()),
            "python_rng_kept": before[2] == after[2],
            "threads_kept": before[3] == after[3],
            "threads_settable": threads_settable,
        }

    @register("ONE_TO_ALL")
    def build_hf(self, config: dict[str, Any]) -> None:
        from hf_fsdp.rollout import HFRolloutEngine

        self.rollouts["hf"] = HFRolloutEngine(config)

    # --------------------------------------------------------------- generation
    @register("DP_PROTO")
    def generate(self, batch: Batch, rollout: str, params: dict[str, Any]) -> Batch:
        return self.rollouts[rollout].generate(batch, SamplingParams(**params))

    @register("3D_ALL_MICRO_DP")
    def generate_micro_dp(self, batch: Batch, params: dict[str, Any]) -> Batch:
        """One chunk per generation replica; every TP rank of a replica gets the same one."""
        return self.rollouts["vllm"].generate(batch, SamplingParams(**params))

    @register("ALL_TO_ALL")
    def generate_per_rank(self, batch: Batch, params: dict[str, Any]) -> str:
        """Each rank its own prompts: returns the error text (TP ranks must agree)."""
        try:
            self.rollouts["vllm"].generate(batch, SamplingParams(**params))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    # ------------------------------------------------------------------ training
    @register("DP_PROTO")
    def log_probs(self, batch: Batch, temperature: float) -> Batch:
        return self.actor.compute_log_probs(batch, temperature=temperature)

    @register("DP_PROTO")
    def train(self, batch: Batch) -> dict[str, float]:
        return self.actor.train_step(batch, policy_loss)

    # --------------------------------------------------------------- weight sync
    @register("ONE_TO_ALL")
    def sync(self, bucket_bytes: int, perturb: float = 0.0, rollout: str = "vllm") -> dict:
        """Stream the actor's weights into a rollout engine (optionally perturbed)."""
        from hf_vllm.weights import sync_weights

        target = self.rollouts[rollout]
        if not perturb:
            return sync_weights(self.actor, target, bucket_bytes)
        for bucket in perturbed(self.actor.export_weights(bucket_bytes), perturb):
            target.load_weights(bucket)
        target.finish_weight_sync()
        return target.sync_metrics()

    @register("ONE_TO_ALL")
    def sync_only(self, names: list[str]) -> str:
        """Send only some canonical tensors; returns the error finish_weight_sync raised."""
        engine = self.rollouts["vllm"]
        for bucket in self.actor.export_weights(1 << 20):
            engine.load_weights([(n, t) for n, t in bucket if n in names])
        try:
            engine.finish_weight_sync()
        except ValueError as exc:
            return str(exc)
        return ""

    @register("ONE_TO_ALL")
    def memory_calls(self) -> tuple[bool, bool]:
        engine = self.rollouts["vllm"]
        engine.release_memory()
        released = engine.memory_released
        engine.resume_memory()
        return released, engine.memory_released
