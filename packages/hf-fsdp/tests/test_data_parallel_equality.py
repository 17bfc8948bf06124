"""The CPU data-parallel strategies against FSDP2 on the same batch (two Ray ranks, gloo).

FSDP2 shards are the path every multi-rank feature is tested on (the default); a CPU strategy
(:mod:`hf_fsdp.data_parallel.cpu_replicas`, :mod:`hf_fsdp.data_parallel.cpu_leader`) is
only welcome if it computes the same update: the same loss, the same gradients before the
optimizer step and the same weights after it.  Gradients are compared directly because the
weights alone would hide a wrong scale: AdamW's first step is nearly ``lr * sign(g)``, and a
clipped norm rescales the gradient anyway (so clipping is off here).  The ``wrong-scale``
cases multiply the gradients after the strategy reduced them and check that the comparison
catches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from hf_core.runtime import ResourcePool, WorkerGroup, spawn
from hf_testing.workers import rollout_batch

pytestmark = pytest.mark.usefixtures("ray_cluster")

B, P, R = 8, 6, 7  # global batch, prompt and response lengths
# eps=1e-5: see test_fsdp_dp2.TRAIN; no clipping (it would rescale a wrong gradient back)
SETTINGS = {"lr": 1e-3, "eps": 1e-5, "micro_batch_size": 2, "grad_clip": None}
STRATEGIES = {"replicate": "cpu_replicas", "leader": "cpu_leader"}
"""cpu_data_parallel -> the CPU strategy compared with FSDP2"""
GRAD_ATOL, WEIGHT_ATOL, REL = 1e-6, 1e-6, 1e-5
WRONG_SCALE = 1.01
"""A gradient 1% off: far beyond float32 summation-order noise, far below a failed run's."""


@pytest.fixture(scope="module")
def group(ray_cluster: None) -> Iterator[WorkerGroup]:
    from fsdp_test_workers import EngineWorker

    pool = ResourcePool([2], name="fsdp_dp_equality")
    workers = spawn(pool, {"engines": EngineWorker})["engines"]
    yield workers
    workers.shutdown()
    pool.release()


def _step(group: WorkerGroup, path: Path, mode: str, grad_scale: float = 1.0) -> dict[str, Any]:
    """Rank 0's view of one policy update of the shared batch under ``mode``: metrics, full
    gradients, weights after the step (every rank reports the same metrics and weights)."""
    name = f"equality_{mode}"
    built = group.build(name, {"model_path": str(path), **SETTINGS, "cpu_data_parallel": mode})
    batch = rollout_batch(B, P, R, AutoConfig.from_pretrained(path).vocab_size, seed=41)
    out = group.captured_step(batch, name=name, loss="policy", grad_scale=grad_scale)
    group.drop(name)
    assert out[0]["metrics"] == out[1]["metrics"]
    assert out[0]["weights"].keys() == out[1]["weights"].keys()
    return {"strategy": [b["strategy"] for b in built], **out[0]}


@pytest.fixture(scope="module")
def fsdp2(group: WorkerGroup, models: dict) -> dict[str, Any]:
    return _step(group, models["qwen2_tied"], "fsdp")


def mismatches(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """What differs between two updates beyond float32 summation-order noise, with the
    largest difference of each: ``loss``, ``grad_norm``, ``gradients``, ``weights``."""
    out: dict[str, float] = {}
    for key in ("loss", "grad_norm"):
        a, b = got["metrics"][key], want["metrics"][key]
        if abs(a - b) > REL * abs(b):
            out[key] = abs(a - b)
    for key, atol in (("grads", GRAD_ATOL), ("weights", WEIGHT_ATOL)):
        assert got[key].keys() == want[key].keys() and want[key], key
        worst = max(float((got[key][k] - want[key][k]).abs().max()) for k in want[key])
        close = all(
            torch.allclose(got[key][k], want[key][k], rtol=REL, atol=atol) for k in want[key]
        )
        if not close:
            out["gradients" if key == "grads" else key] = worst
    return out


def test_the_reference_is_an_fsdp2_step_that_moved_the_weights(
    models: dict, fsdp2: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM

    assert fsdp2["strategy"] == ["fsdp2", "fsdp2"]
    assert fsdp2["metrics"]["data_parallel/fsdp2"] == 1.0
    norm = float(torch.stack([g.norm() for g in fsdp2["grads"].values()]).norm())
    assert fsdp2["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)  # nothing clipped
    loaded = AutoModelForCausalLM.from_pretrained(models["qwen2_tied"]).state_dict()
    moved = max(float((w - loaded[k]).abs().max()) for k, w in fsdp2["weights"].items())
    assert moved > 100 * WEIGHT_ATOL  # so equal weights below mean an equal step


@pytest.mark.parametrize("mode", STRATEGIES)
def test_cpu_strategy_computes_the_fsdp2_update(
    group: WorkerGroup, models: dict, fsdp2: dict[str, Any], mode: str
) -> None:
    got = _step(group, models["qwen2_tied"], mode)
    assert got["strategy"] == [STRATEGIES[mode]] * 2
    assert got["metrics"][f"data_parallel/{STRATEGIES[mode]}"] == 1.0
    assert mismatches(got, fsdp2) == {}


@pytest.mark.parametrize("mode", STRATEGIES)
def test_a_wrong_gradient_scale_is_caught(
    group: WorkerGroup, models: dict, fsdp2: dict[str, Any], mode: str
) -> None:
    """The same comparison fails when the strategy's reduced gradients are 1% off, while the
    loss (the forward) still agrees: the check above can fail."""
    got = _step(group, models["qwen2_tied"], mode, grad_scale=WRONG_SCALE)
    differs = mismatches(got, fsdp2)
    assert "gradients" in differs and "grad_norm" in differs, differs
    assert "loss" not in differs
