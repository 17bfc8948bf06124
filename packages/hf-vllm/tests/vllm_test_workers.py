"""A test worker hosting the hybrid engine pieces on each rank: an FSDP actor, the vLLM engine
and (as the reference for batch conventions) the transformers rollout engine.

Importable by the Ray worker processes (the tests folder is put on their PYTHONPATH).  It is
also a sketch of what core's actor worker does with a vLLM rollout engine: build the training
engine first, then the rollout engine, report the generation mesh, stream weights after each
update.
"""

from __future__ import annotations

import contextlib
import random
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
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
    name: str,
    model_path: Path,
    actor: dict[str, Any],
    vllm: dict[str, Any],
    transformers: bool = False,
) -> Iterator[Any]:
    """Two ranks of :class:`HybridWorker`, each with an FSDP actor (``actor`` settings), the
    vLLM engine (``vllm`` settings; ``group.info`` holds what ``build_vllm`` reported) and,
    with ``transformers``, the transformers rollout engine, all on ``model_path``."""
    from hf_core.runtime import ResourcePool, spawn

    pool = ResourcePool([2], name=name)
    workers = spawn(pool, {"hybrid": HybridWorker})["hybrid"]
    path = str(model_path)
    workers.build_actor({"model_path": path, **actor})
    if transformers:
        workers.build_transformers(
            {"model_path": path, "dtype": "float32"}
        )  # vLLM runs float32 here
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
    """FSDP actor + vLLM rollout (+ transformers rollout) in one process per rank."""

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
    def build_transformers(self, config: dict[str, Any]) -> None:
        from hf_fsdp.rollout import TransformersRolloutEngine

        self.rollouts["transformers"] = TransformersRolloutEngine(config)

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
    def memory_calls(self) -> tuple[bool, bool, int, int]:
        """Whether weights count as released during and after; on the CPU the KV cache's
        bytes freed and the fall of this process's RSS."""
        engine = self.rollouts["vllm"]
        rss = psutil.Process().memory_info().rss
        engine.release_memory()
        released = engine.memory_released
        fall = rss - psutil.Process().memory_info().rss
        engine.resume_memory()
        return released, engine.memory_released, engine._memory.cpu_freed_bytes, fall

    @register("ONE_TO_ALL")
    def memory_bytes(self) -> tuple[int, int]:
        """What release_memory / resume_memory report (on the CPU: the bytes they would move)."""
        engine = self.rollouts["vllm"]
        return engine.release_memory(), engine.resume_memory()

    @register("ONE_TO_ALL")
    def slice_layout(self) -> tuple[bool, int, int]:
        """Whether the engine loads TP slices, and its generation layout (pp, tp)."""
        from hf_core.engines import LoadsTPSlices

        engine = self.rollouts["vllm"]
        if not isinstance(engine, LoadsTPSlices):
            return False, 0, 0
        layout = engine.generation_layout()
        return True, layout.pp, layout.tp

    @register("ONE_TO_ALL")
    def sync_folder_slices(
        self, model_path: str, bucket_bytes: int, perturb: float, divisible_by: int
    ) -> dict[str, Any]:
        """Load the folder's weights perturbed (whole tensors), then this rank's megatron TP
        slices of the original ones; returns the sync metrics, or ``{"error": text}``."""
        from hf_core.engines import iter_buckets
        from hf_testing.conformance.reference import folder_tensors
        from hf_testing.conformance.reference import perturbed as noisy

        engine = self.rollouts["vllm"]
        tensors = folder_tensors(model_path)
        for bucket in iter_buckets(noisy(tensors, perturb).items(), bucket_bytes):
            engine.load_weights(bucket)
        engine.finish_weight_sync()
        layout = engine.generation_rank()
        slices = megatron_slices(tensors, layout.tp_rank, layout.tp_size, divisible_by)
        try:
            for bucket in slice_buckets(slices, bucket_bytes):
                engine.load_weights(bucket)
        except ValueError as exc:
            with contextlib.suppress(ValueError):  # layers of earlier buckets left half-sent
                engine.finish_weight_sync()
            return {"error": str(exc)}
        engine.finish_weight_sync()
        return engine.sync_metrics()


# ------------------------------------------------------------- megatron's TP partition
# What hf-megatron's ``tp_slice_range`` documents (hf_megatron is not installed in this
# session): q/k/v/gate/up along dim 0 (one contiguous block per rank, q/k/v by heads),
# o/down along dim 1, vocabulary rows over the vocabulary padded to a multiple of
# ``make_vocab_size_divisible_by * tp``, split evenly and clipped to the real vocabulary;
# everything else whole.


def megatron_range(
    name: str, shape: tuple[int, ...], tp_rank: int, tp: int, vocab: int, divisible_by: int
) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of TP rank ``tp_rank``'s block of a canonical tensor, or None."""
    module = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        multiple = divisible_by * tp
        per = -(-vocab // multiple) * multiple // tp
        return 0, min(tp_rank * per, vocab), min((tp_rank + 1) * per, vocab)
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        per = shape[0] // tp
        return 0, tp_rank * per, (tp_rank + 1) * per
    if module in ("o_proj", "down_proj"):
        per = shape[1] // tp
        return 1, tp_rank * per, (tp_rank + 1) * per
    return None


def megatron_slices(
    tensors: Mapping[str, torch.Tensor], tp_rank: int, tp: int, divisible_by: int
) -> list[Any]:
    """This rank's generation-TP slices of full canonical tensors, as a reshard streams them."""
    from hf_core.engines import CanonicalSlice

    vocab = tensors["model.embed_tokens.weight"].shape[0]
    out = []
    for name, full in tensors.items():
        shape = tuple(full.shape)
        block = megatron_range(name, shape, tp_rank, tp, vocab, divisible_by)
        if block is None:
            out.append(CanonicalSlice(name, full, None, 0, shape))
            continue
        dim, start, stop = block
        part = full.narrow(dim, start, stop - start).clone()  # a shard of its own, as received
        out.append(CanonicalSlice(name, part, dim, start, shape))
    return out


def slice_buckets(slices: list[Any], bucket_bytes: int) -> Iterator[list[Any]]:
    """Slices in buckets of at most ``bucket_bytes`` (a slice larger than that goes alone)."""
    bucket: list[Any] = []
    size = 0
    for item in slices:
        if bucket and size + item.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += item.nbytes
    if bucket:
        yield bucket
