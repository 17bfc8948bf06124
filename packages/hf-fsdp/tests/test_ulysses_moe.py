"""Routing replay and the router losses under Ulysses sequence parallelism (issue 59): two
gloo ranks split each micro-batch's tokens of the tiny MoE model, whose routers were changed
after the rollout recorded its experts.

- the ranks' MoE layers run exactly the recorded experts of their own columns (checked
  against the recorded rows directly, not through the engine's layout; control: without
  replay they run others);
- the replayed log-probs equal one rank's replayed log-probs (packed and per-row layouts);
- a replayed train step with both router losses gives one rank's loss, router losses,
  routing metrics, gradients and updated weights (with activation checkpointing too).

The two ranks run in one ``torch.multiprocessing`` spawn (gloo on the loopback) and write
their results to a file; one rank (``sequence_parallel_size`` 1) runs in the test process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, unrecorded
from hf_testing.workers import policy_loss, rollout_batch

ATOL = 1e-5
B, P, R = 6, 9, 7
TRAIN = {"lr": 1e-3, "eps": 1e-5, "micro_batch_size": 2, "grad_clip": 1.0, "seed": 0}
SETTINGS = {
    "packed": {},
    "padded-rows": {"sequence_packing": False},
    "recomputed-fsdp-layers": {
        "cpu_data_parallel": "fsdp",
        "gradient_checkpointing": True,
        "fsdp_unit": "layer",
    },
}
COEFS = {"moe_aux_loss_coef": 0.3, "moe_z_loss_coef": 0.2}


class _Loss:
    """The test workers' policy loss with the algorithm config the engine reads the router
    loss coefficients from (as hf_core's PolicyLoss carries it)."""

    def __init__(self, **coefs: float) -> None:
        self.algo = AlgorithmConfig(**coefs)

    def __call__(self, outputs: Mapping[str, torch.Tensor], mb: Batch) -> Any:
        return policy_loss(outputs, mb)


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _routers(model: Any) -> list[Any]:
    from hf_fsdp.moe_routing import moe_routers

    return moe_routers(model)


def _recorded_batch(path: Path) -> Batch:
    """A rollout batch with the experts a router other than the checkpoint's chose: the
    trainer's router has moved on since the rollout.  Padding and each row's last token
    (never fed in a rollout) are unrecorded."""
    from hf_fsdp.moe_routing import RoutingRecorder

    model = _load(path)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for router in _routers(model):
            router.weight.add_(2.0 * torch.randn(router.weight.shape, generator=gen))
    batch = rollout_batch(B, P, R, int(model.config.vocab_size), seed=11)
    mask = batch["attention_mask"].bool()
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
        routed = recorder.take(*mask.shape)
    last = (mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)) & mask
    routed[~mask | last] = unrecorded(routed.dtype)
    batch[ROUTED_EXPERTS_KEY] = routed
    return batch


def _experts_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def _run_experts(model: Any, call: Any) -> list[torch.Tensor]:
    """The top-k ids each MoE layer's experts ran in ``call()`` (``[tokens, k]`` per layer,
    the first forward of each layer)."""
    used: dict[int, torch.Tensor] = {}
    handles = []
    for layer, module in enumerate(_experts_modules(model)):

        def keep(_m: Any, args: Any, _out: Any, layer: int = layer) -> None:
            used.setdefault(layer, args[1].detach().clone())

        handles.append(module.register_forward_hook(keep))
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return [used[layer] for layer in sorted(used)]


def _gradients(model: Any) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _step(engine: Any, batch: Batch) -> dict[str, Any]:
    """One replayed update with both router losses: metrics, the full gradients the
    optimizer applied, and the updated weights."""
    grads: dict[str, torch.Tensor] = {}
    handle = engine.optimizer.register_step_pre_hook(
        lambda *_: grads.update(_gradients(engine.model))
    )
    metrics = engine.train_step(batch, _Loss(**COEFS))
    handle.remove()
    weights = {k: v.clone() for bucket in engine.export_weights(1 << 20) for k, v in bucket}
    return {"metrics": metrics, "grads": grads, "weights": weights}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(rank: int, world: int, port: int, path: str, out: str) -> None:
    """One rank of the SP = 2 group: for each setting, the replayed log-probs, the experts
    its layers ran on its columns (replayed and not), and a replayed train step."""
    from hf_fsdp import heads
    from hf_fsdp.engine import FSDPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    batch = torch.load(Path(out) / "batch.pt", weights_only=False)
    results: dict[str, Any] = {}
    for name, settings in SETTINGS.items():
        engine = FSDPEngine({"model_path": path, **TRAIN, **settings, "sequence_parallel_size": 2})
        packed = engine.config.sequence_packing
        log_probs = engine.compute_log_probs(batch)

        def direct(b: Batch, engine: Any = engine, packed: bool = packed) -> None:
            with torch.no_grad():  # one micro-batch of the whole batch, no planning
                heads.sequence_parallel_forward(
                    "lm",
                    engine.model,
                    b,
                    engine.device,
                    engine.sp_group,
                    sequence_packing=packed,
                )

        engine.model.eval()
        replayed = _run_experts(engine.model, lambda: direct(batch))
        free = batch.select(*(k for k in batch.keys() if k != ROUTED_EXPERTS_KEY))
        unreplayed = _run_experts(engine.model, lambda free=free: direct(free))
        results[name] = {
            "log_probs": log_probs,
            "replayed": replayed,
            "unreplayed": unreplayed,
            **_step(engine, batch),
        }
        del engine
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def runs(moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The batch, both SP ranks' results per setting, and one rank's (SP = 1)."""
    from hf_fsdp.engine import FSDPEngine

    out = tmp_path_factory.mktemp("sp_moe")
    batch = _recorded_batch(moe_path)
    torch.save(batch, out / "batch.pt")
    mp.spawn(_pair, args=(2, _free_port(), str(moe_path), str(out)), nprocs=2)
    pair = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    one: dict[str, Any] = {}
    for name, settings in SETTINGS.items():
        engine = FSDPEngine({"model_path": str(moe_path), **TRAIN, **settings})
        free = batch.select(*(k for k in batch.keys() if k != ROUTED_EXPERTS_KEY))
        one[name] = {
            "log_probs": engine.compute_log_probs(batch),
            "free_log_probs": engine.compute_log_probs(free),
            **_step(engine, batch),
        }
    return {"batch": batch, "pair": pair, "one": one}


def _response_diff(a: torch.Tensor, b: torch.Tensor, batch: Batch) -> float:
    mask = batch["response_mask"].bool()
    return float((a - b)[mask].abs().max())


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_rank_runs_the_recorded_experts_of_its_columns(runs: dict, setting: str) -> None:
    """Concatenated over the two ranks, the experts the layers ran are, for every real token
    with a record, the recorded ones: packed, the real tokens in row order; per row, each
    row's real tokens first (read off the recorded rows, not through the engine's layout).
    Control: without replay the changed routers run other experts."""
    batch = runs["batch"]
    mask = batch["attention_mask"].bool()
    routed = batch[ROUTED_EXPERTS_KEY]
    packed = SETTINGS[setting].get("sequence_packing", True)
    lengths = mask.sum(-1)
    for key, should_match in (("replayed", True), ("unreplayed", False)):
        ranks = [runs["pair"][r][setting][key] for r in (0, 1)]
        differs = False
        for layer in range(routed.shape[2]):
            local = [ranks[r][layer] for r in (0, 1)]
            assert local[0].shape == local[1].shape  # each rank routes its own half
            rows = 1 if packed else len(batch)
            whole = torch.cat([t.reshape(rows, -1, t.shape[-1]) for t in local], dim=1)
            if packed:
                ran = whole[0, : int(lengths.sum())]
                want = routed[mask][:, layer]
            else:
                ran = torch.cat([whole[i, : int(n)] for i, n in enumerate(lengths)])
                want = torch.cat([routed[i][mask[i]][:, layer] for i in range(len(batch))])
            recorded = (want != unrecorded(want.dtype)).all(-1)
            assert int(recorded.sum()) > 0
            same = ran[recorded].sort(-1).values == want[recorded].long().sort(-1).values
            if should_match:
                assert bool(same.all()), (setting, layer)
            differs |= not bool(same.all())
        if not should_match:
            assert differs, setting


@pytest.mark.parametrize("setting", SETTINGS)
def test_replayed_log_probs_equal_one_rank(runs: dict, setting: str) -> None:
    batch, one = runs["batch"], runs["one"][setting]
    # control: replay changes the log-probs (the routers moved since the rollout)
    assert (
        _response_diff(one["free_log_probs"]["log_probs"], one["log_probs"]["log_probs"], batch)
        > 1e-3
    )
    for rank in (0, 1):
        got = runs["pair"][rank][setting]["log_probs"]
        for key in ("log_probs", "entropy"):
            diff = _response_diff(got[key], one["log_probs"][key], batch)
            assert diff < ATOL, (rank, key, diff)


@pytest.mark.parametrize("setting", SETTINGS)
def test_replayed_step_with_router_losses_equals_one_rank(runs: dict, setting: str) -> None:
    """Loss, both router losses, routing metrics (each real token counted once over the
    group), gradient norm, every gradient and every updated weight."""
    want = runs["one"][setting]
    for rank in (0, 1):
        got = runs["pair"][rank][setting]
        metrics, expected = got["metrics"], want["metrics"]
        for key in ("loss", "moe/aux_loss", "moe/z_loss", "grad_norm"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (rank, key)
        assert expected["moe/router_agreement"] < 1.0  # the trainer's router would differ
        for key in (
            "moe/router_agreement",
            "moe/expert_load_max_over_mean",
            "moe/expert_load_max_over_mean_max",
        ):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-6), (rank, key)
        assert got["grads"].keys() == want["grads"].keys()
        routers = [k for k in want["grads"] if k.endswith("mlp.gate.weight")]
        assert routers and all(float(want["grads"][k].abs().sum()) > 0 for k in routers)
        for part in ("grads", "weights"):
            worst = max((float((got[part][k] - want[part][k]).abs().max()), k) for k in want[part])
            assert worst[0] < ATOL, (rank, part, worst)
