"""Canonical (HF) tensors -> a running SGLang engine, in buckets, by one of two transports.

* :class:`TensorTransport` (``weight_sync: tensor``, hybrid / colocated): each bucket goes
  through ``Engine.update_weights_from_tensor``; SGLang serialises the tensors by handle
  (CUDA IPC on GPU, shared memory on CPU), so nothing is copied through a socket.
* :class:`DistributedTransport` (``weight_sync: distributed``, standalone placement): a process
  group joins this process (rank 0) and the engine's TP ranks (``init_weights_update_group``);
  each bucket is announced with ``update_weights_from_distributed`` (names, dtypes, shapes)
  and its tensors are broadcast from rank 0 while the engine receives them.

Either way a sync is ``begin_weight_update`` -> buckets -> ``end_weight_update`` and then
``flush_cache`` (the radix cache holds KV computed with the old weights).  SGLang loads
q/k/v and gate/up into its fused layers shard by shard, so a bucket boundary may fall
anywhere; a tied ``lm_head`` is the embedding module itself and follows it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from hf_core.device import distributed_backend
from hf_core.engines import NamedTensor
from hf_core.sync import SyncStats
from hf_sglang.config import SyncGroupConfig


class WeightSyncError(RuntimeError):
    """SGLang refused or failed a step of a weight sync."""


def check_result(what: str, result: Any) -> None:
    """SGLang's control calls answer ``(success, message)`` or an object with ``success``."""
    if result is None:
        return
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        success = getattr(result, "success", True)
        message = getattr(result, "message", "")
    if not success:
        raise WeightSyncError(f"SGLang {what} failed: {message}")


def canonical_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Shapes of the canonical tensors a training engine sends (tied aliases left out): the
    checkpoint's names, so a mixture of experts' fused tensors are one tensor per expert
    (:func:`hf_core.engines.model_classes.checkpoint_shapes`), as SGLang loads them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_core.engines.model_classes import checkpoint_shapes

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return checkpoint_shapes(model, [name for name, _ in model.named_parameters()])


def check_bucket(bucket: Sequence[NamedTensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail before SGLang half-loads a bucket: unknown names and wrong shapes."""
    for name, tensor in bucket:
        shape = shapes.get(name)
        if shape is None:
            raise KeyError(f"the rollout model has no parameter {name!r}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, rollout model has {shape}")


class TensorTransport:
    """Buckets through ``update_weights_from_tensor`` (same host as the engine)."""

    name = "tensor"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def send(self, bucket: list[NamedTensor]) -> None:
        result = self.engine.update_weights_from_tensor(bucket, flush_cache=False)
        check_result("update_weights_from_tensor", result)

    def close(self) -> None:
        """Nothing to release."""


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run a blocking engine call beside this thread's collectives; result or error in a box."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # re-raised by the caller after join
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _joined(thread: threading.Thread, box: dict[str, Any], what: str, timeout: float) -> Any:
    thread.join(timeout)
    if thread.is_alive():
        raise WeightSyncError(f"SGLang {what} did not answer within {timeout:.0f} s")
    if "error" in box:
        raise WeightSyncError(f"SGLang {what} raised: {box['error']!r}") from box["error"]
    check_result(what, box.get("result"))
    return box.get("result")


class DistributedTransport:
    """Buckets broadcast over a process group from this process (rank 0) to the engine."""

    name = "distributed"

    def __init__(self, engine: Any, group: SyncGroupConfig, engine_ranks: int, device: str) -> None:
        self.engine = engine
        self.config = group
        self.engine_ranks = engine_ranks
        self.backend = group.backend if group.backend != "auto" else distributed_backend(device)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if (self.backend == "nccl")
            else torch.device("cpu")
        )
        self.group: Any = None
        self.port: int | None = None

    def _connect(self) -> None:
        """Create the group: the engine joins as ranks 1..tp while this process is rank 0."""
        from sglang.srt.utils import init_custom_process_group

        cfg = self.config
        self.port = cfg.master_port or free_port(cfg.master_address)
        world = 1 + self.engine_ranks
        thread, box = _in_thread(
            lambda: self.engine.init_weights_update_group(
                cfg.master_address, self.port, 1, world, cfg.group_name, backend=self.backend
            )
        )
        self.group = init_custom_process_group(
            backend=self.backend,
            init_method=f"tcp://{cfg.master_address}:{self.port}",
            world_size=world,
            rank=0,
            group_name=cfg.group_name,
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        _joined(thread, box, "init_weights_update_group", cfg.timeout_s)

    def send(self, bucket: list[NamedTensor]) -> None:
        if self.group is None:
            self._connect()
        names = [name for name, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        thread, box = _in_thread(
            lambda: self.engine.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self.config.group_name, flush_cache=False
            )
        )
        for _, tensor in bucket:
            torch.distributed.broadcast(
                tensor.detach().to(self.device).contiguous(), src=0, group=self.group
            )
        _joined(thread, box, "update_weights_from_distributed", self.config.timeout_s)

    def close(self) -> None:
        """Leave the group (the engine first, then this side)."""
        if self.group is None:
            return
        check_result(
            "destroy_weights_update_group",
            self.engine.destroy_weights_update_group(self.config.group_name),
        )
        torch.distributed.destroy_process_group(self.group)
        self.group = None


@dataclass
class SGLangSyncStats(SyncStats):
    """Core's sync numbers and the transport that carried them (``engine_seconds``: time
    inside SGLang calls -- begin, buckets, end, cache flush)."""

    transport: str = "tensor"
