"""Routing replay on a transformers MoE model (hf_fsdp.moe_routing): experts recorded in one
forward are the experts a later forward runs, whatever that forward's router would choose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, unrecorded
from hf_fsdp import heads
from hf_fsdp.moe_routing import RoutingRecorder, RoutingStats, moe_routers, replaying
from hf_testing.workers import rollout_batch


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _experts_used(model: Any) -> tuple[list[torch.Tensor], list[Any]]:
    used: list[torch.Tensor] = []

    def keep(_module: Any, args: Any, _output: Any) -> None:
        used.append(args[1].detach().clone())  # the experts module's top_k_index argument

    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    return used, [m.register_forward_hook(keep) for m in experts]


def _record(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return logits, recorder.take(*ids.shape)


def test_replaying_the_models_own_routing_changes_nothing(moe_path: Path) -> None:
    model = _load(moe_path)
    ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    plain, routed = _record(model, ids)
    assert routed.shape == (3, 9, len(moe_routers(model)), 2) and routed.dtype == torch.uint8
    stats = RoutingStats()
    with torch.no_grad(), replaying(model, routed, torch.ones_like(ids), stats):
        again = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(again, plain)
    assert stats.metrics()["moe/router_agreement"] == 1.0


def test_a_changed_router_still_runs_the_recorded_experts_and_learns(moe_path: Path) -> None:
    model = _load(moe_path)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    _, routed = _record(model, ids)
    with torch.no_grad():  # the trainer's router has moved on since the rollout
        for router in moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight))
    used, handles = _experts_used(model)
    stats = RoutingStats()
    model.train()
    with replaying(model, routed, torch.ones_like(ids), stats):
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
    for handle in handles:
        handle.remove()
    for layer, ids_used in enumerate(used):
        want = routed[:, :, layer].reshape(-1, 2).long().sort(-1).values
        assert torch.equal(ids_used.sort(-1).values, want), layer
    assert stats.metrics()["moe/router_agreement"] < 1.0  # it would have routed elsewhere
    assert all(
        r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model)
    )

    used, handles = _experts_used(model)  # control: without replay the new router decides
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for handle in handles:
        handle.remove()
    assert any(
        not torch.equal(u.sort(-1).values, routed[:, :, i].reshape(-1, 2).long().sort(-1).values)
        for i, u in enumerate(used)
    )


def test_unrecorded_positions_route_as_the_trainer_chooses(moe_path: Path) -> None:
    model = _load(moe_path)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    plain, routed = _record(model, ids)
    routed[:, -1] = unrecorded(routed.dtype)  # e.g. a response's last token
    with torch.no_grad(), replaying(model, routed, torch.ones_like(ids)):
        again = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(again, plain)


def test_routing_from_another_layout_is_refused(moe_path: Path) -> None:
    model = _load(moe_path)
    ids = torch.randint(3, 100, (2, 6))
    _, routed = _record(model, ids)
    with pytest.raises(ValueError, match="cover 1 MoE layers, the model has 2"):
        with replaying(model, routed[:, :, :1], torch.ones_like(ids)):
            pass
    with (
        pytest.raises(ValueError, match="replay needs the rows as recorded or packed"),
        replaying(model, routed[:, :5], torch.ones_like(ids[:, :5])),
    ):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_replay_through_sequence_packing_runs_the_recorded_experts(moe_path: Path) -> None:
    """A replayed log-prob forward packs the rows' real tokens into one row (sequence
    packing): each packed token runs its recorded experts, and the log-probs equal the
    replayed forward of the padded rows."""
    model = _load(moe_path)
    model.config._attn_implementation = "sdpa"
    batch = rollout_batch(4, 6, 5, int(model.config.vocab_size), seed=4)
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # left-padded prompts, right-padded responses
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
        routed = recorder.take(*mask.shape)
    routed[~mask] = unrecorded(routed.dtype)
    with torch.no_grad():  # the trainer's router has moved on since the rollout
        for router in moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight))
    batch[ROUTED_EXPERTS_KEY] = routed
    assert heads.sequence_packed_inputs(model, batch, torch.device("cpu")) is not None

    used, handles = _experts_used(model)
    with torch.no_grad():
        packed = heads.lm_forward(model, batch, torch.device("cpu"), 1.0, False)
    for handle in handles:
        handle.remove()
    assert used[0].shape[0] == int(mask.sum())  # one packed row of the real tokens
    for layer, ids_used in enumerate(used):
        want = routed[mask][:, layer].long().sort(-1).values
        assert torch.equal(ids_used.sort(-1).values, want), layer
    with torch.no_grad():
        rows = heads.lm_forward(
            model, batch, torch.device("cpu"), 1.0, False, sequence_packing=False
        )
    response = batch["response_mask"].bool()
    torch.testing.assert_close(
        packed["log_probs"][response], rows["log_probs"][response], rtol=1e-5, atol=1e-5
    )
