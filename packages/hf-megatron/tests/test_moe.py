"""Mixture-of-experts (Qwen3-MoE) on the megatron engine: the weight mapping against
transformers, expert parallelism against one rank, the per-expert export, routing replay.

Each test runs its ranks as fresh processes (``torch.multiprocessing`` + gloo): megatron keeps
its process groups in module globals, and a new ``ep`` needs new groups.  References are
plain transformers, independent of hf_megatron's code.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_core.batch import Batch
from hf_testing.conformance.reference import hf_log_probs_and_entropy
from hf_testing.tiny import build_tiny_model
from hf_testing.workers import rollout_batch

B, P, R = 4, 6, 7


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, *args)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, tmp: Path) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` fresh gloo ranks; every rank's result."""
    out = str(tmp / f"result_{time.monotonic_ns()}")
    mp.spawn(_rank_main, args=(world, _free_port(), fn, args, out), nprocs=world)
    results = []
    for rank in range(world):
        with open(f"{out}.{rank}", "rb") as f:
            results.append(pickle.load(f))
    return results


def _engine(path: Path, **extra: Any) -> Any:
    from hf_megatron.engine import MegatronEngine

    return MegatronEngine({"model_path": str(path), "seed": 0, **extra})


def _vocab(path: Path) -> int:
    return int(AutoConfig.from_pretrained(path).vocab_size)


# ---------------------------------------------------------------- (b) log-probs vs transformers


def _log_probs(rank: int, path: Path, batch: Batch) -> Batch:
    engine = _engine(path, trainable=False, micro_batch_size=2)
    return engine.compute_log_probs(batch, temperature=0.7)


def test_log_probs_equal_transformers(moe_model: Path, tmp_path: Path) -> None:
    batch = rollout_batch(B, P, R, _vocab(moe_model), seed=3)
    (out,) = run_ranks(1, _log_probs, moe_model, batch, tmp=tmp_path)
    expected, entropy = hf_log_probs_and_entropy(
        AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32), batch, 0.7
    )
    mask = batch["response_mask"]
    assert float(((out["log_probs"] - expected) * mask).abs().max()) < 1e-4
    assert float(((out["entropy"] - entropy) * mask).abs().max()) < 1e-4


# ---------------------------------------------------------------- (c) export round trip


def _export(rank: int, path: Path, ep: int) -> dict[str, torch.Tensor]:
    engine = _engine(path, trainable=False, expert_parallel_size=ep)
    return {n: t.clone() for bucket in engine.export_weights(1 << 14) for n, t in bucket}


@pytest.mark.parametrize("ep", [1])
def test_export_is_the_checkpoint_per_expert(moe_model: Path, tmp_path: Path, ep: int) -> None:
    state = load_file(moe_model / "model.safetensors")
    for exported in run_ranks(ep, _export, moe_model, ep, tmp=tmp_path):
        assert exported.keys() == state.keys()
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
        for name, tensor in state.items():
            assert torch.equal(exported[name], tensor), name
