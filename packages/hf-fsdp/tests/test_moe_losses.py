"""The load-balancing and router z losses of an MoE model's training forward
(``algorithm.moe_aux_loss_coef`` / ``moe_z_loss_coef``; hf_fsdp.moe_routing.RouterLosses),
and the check of a batch's routed expert ids against the model (before any forward)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, unrecorded
from hf_core.errors import DataError
from hf_fsdp import heads
from hf_fsdp.engine import FSDPEngine
from hf_fsdp.moe_routing import RoutingRecorder, check_routing, moe_routers
from hf_testing.workers import policy_loss, rollout_batch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch(model: Any, seed: int = 0) -> Batch:
    batch = rollout_batch(4, 6, 5, int(model.config.vocab_size), seed=seed)
    assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()  # padding
    return batch


def _reference(model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward losses from transformers' own router logits: per layer over the real
    tokens, E * sum_e (share of top-k slots at e) * (mean probability of e), and
    mean(logsumexp(logits)^2); each averaged over the layers."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        output_router_logits=True,
        use_cache=False,
    )
    real = batch["attention_mask"].reshape(-1).bool()
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    aux, z = [], []
    for logits in out.router_logits:
        kept = logits[real].float()
        probs = kept.softmax(-1)
        chosen = probs.topk(k, dim=-1).indices
        slots = torch.nn.functional.one_hot(chosen, experts).float().sum(dim=(0, 1))
        share = slots / (kept.shape[0] * k)
        aux.append(experts * (share * probs.mean(0)).sum())
        z.append((torch.logsumexp(kept, dim=-1) ** 2).mean())
    return torch.stack(aux).mean(), torch.stack(z).mean()


def _ours(model: Any, batch: Batch) -> dict[str, torch.Tensor]:
    return heads.forward(
        "lm", model, batch, CPU, tokens=heads.ForwardTokens(), sequence_packing=False
    )


def _router_grads(model: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [r.weight for r in moe_routers(model)]))


def test_losses_equal_a_plain_implementation_values_and_router_gradients(
    moe_path: Path,
) -> None:
    model = _load(moe_path).train()
    batch = _batch(model)
    want_aux, want_z = _reference(model, batch)
    out = _ours(model, batch)
    aux, z = out[heads.MOE_AUX_LOSS], out[heads.MOE_Z_LOSS]
    torch.testing.assert_close(aux, want_aux, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(z, want_z, rtol=1e-6, atol=1e-7)
    assert 0 < float(aux.detach()) <= model.config.num_experts and float(z.detach()) > 0
    for got, want in zip(_router_grads(model, aux), _router_grads(model, want_aux), strict=True):
        assert got.abs().sum() > 0  # the router learns from the load-balancing loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    out = _ours(model, batch)
    want_aux, want_z = _reference(model, batch)
    for got, want in zip(
        _router_grads(model, out[heads.MOE_Z_LOSS]), _router_grads(model, want_z), strict=True
    ):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


def test_padding_counts_nothing(moe_path: Path) -> None:
    model = _load(moe_path).eval()
    batch = _batch(model, seed=3)
    pads = batch["attention_mask"] == 0
    other = Batch({key: batch[key] for key in batch.keys()})
    other["input_ids"] = batch["input_ids"].masked_fill(pads, 7)  # other tokens where padded
    with torch.no_grad():
        same = [_ours(model, b) for b in (batch, other)]
        for key in (heads.MOE_AUX_LOSS, heads.MOE_Z_LOSS):
            torch.testing.assert_close(same[0][key], same[1][key], rtol=1e-6, atol=1e-7)
        # control: the padded positions' router logits did change, and counting them would show
        plain = model(input_ids=batch["input_ids"], output_router_logits=True).router_logits
        moved = model(input_ids=other["input_ids"], output_router_logits=True).router_logits
    flat = pads.reshape(-1)
    assert not torch.allclose(plain[0][flat], moved[0][flat])


def test_sequence_packing_gives_the_same_losses(moe_path: Path) -> None:
    model = _load(moe_path).eval()
    model.config._attn_implementation = "sdpa"
    batch = _batch(model, seed=4)
    with torch.no_grad():
        plain = _ours(model, batch)
        inputs = heads.sequence_packed_inputs(model, batch, CPU)
        packed = heads.lm_forward(
            model, batch, CPU, 1.0, True, shared_prefix=False, tokens=heads.ForwardTokens()
        )
    if inputs is None:
        pytest.skip("sequence packing does not pay on this batch")
    for key in (heads.MOE_AUX_LOSS, heads.MOE_Z_LOSS):
        torch.testing.assert_close(packed[key], plain[key], rtol=1e-5, atol=1e-6)


def test_log_prob_forwards_carry_no_router_losses(moe_path: Path) -> None:
    model = _load(moe_path).eval()
    with torch.no_grad():
        out = heads.forward("lm", model, _batch(model), CPU)
    assert heads.MOE_AUX_LOSS not in out and heads.MOE_Z_LOSS not in out


class _Loss:
    """The test workers' policy loss, with the algorithm config the engine reads the
    coefficients from (as :class:`hf_core.roles.losses.PolicyLoss` carries it)."""

    def __init__(self, **coefs: float) -> None:
        self.algo = AlgorithmConfig(**coefs)

    def __call__(self, outputs: Mapping[str, torch.Tensor], mb: Batch) -> Any:
        return policy_loss(outputs, mb)


def _engine(path: Path) -> FSDPEngine:
    return FSDPEngine(
        {
            "model_path": str(path),
            "lr": 1e-2,
            "seed": 0,
            "shared_prefix": False,
            "sequence_packing": False,
        }
    )


def _routers(engine: FSDPEngine) -> list[torch.Tensor]:
    return [r.weight.detach().clone() for r in moe_routers(engine.model)]


def test_engine_adds_the_losses_with_their_coefficients(
    moe_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = _batch(_load(moe_path), seed=5)
    runs = {}
    for name, loss in {
        "off": _Loss(),
        "aux": _Loss(moe_aux_loss_coef=0.5),
        "z": _Loss(moe_z_loss_coef=0.5),
    }.items():
        engine = _engine(moe_path)
        metrics = engine.train_step(batch, loss)
        runs[name] = (metrics, _routers(engine))
    off, aux, z = (runs[n][0] for n in ("off", "aux", "z"))
    for m in (off, aux, z):  # reported whatever the coefficient
        assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] > 0
    assert aux["moe/aux_loss"] == pytest.approx(off["moe/aux_loss"], rel=1e-6)
    assert aux["loss"] - off["loss"] == pytest.approx(0.5 * off["moe/aux_loss"], rel=1e-4)
    assert z["loss"] - off["loss"] == pytest.approx(0.5 * off["moe/z_loss"], rel=1e-4)
    for name in ("aux", "z"):  # the routers moved differently
        assert any(
            not torch.equal(a, b) for a, b in zip(runs[name][1], runs["off"][1], strict=True)
        )

    # coefficient 0 leaves the update as it is without any router loss
    monkeypatch.setattr(heads, "moe_routers", lambda _model: [])
    engine = _engine(moe_path)
    plain = engine.train_step(batch, _Loss())
    assert "moe/aux_loss" not in plain and plain["loss"] == off["loss"]
    for a, b in zip(_routers(engine), runs["off"][1], strict=True):
        assert torch.equal(a, b)


def _recorded(model: Any, batch: Batch) -> torch.Tensor:
    ids = batch["input_ids"]
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(input_ids=ids, attention_mask=batch["attention_mask"])
        return recorder.take(*ids.shape)


def test_out_of_range_expert_ids_are_refused_before_any_forward(moe_path: Path) -> None:
    model = _load(moe_path).eval()
    batch = _batch(model, seed=6)
    routed = _recorded(model, batch)
    routers = moe_routers(model)
    check_routing(routers, routed)  # the model's own routing fits
    marked = routed.clone()
    marked[:, 0] = unrecorded(routed.dtype)  # the sentinel is no expert id
    check_routing(routers, marked)

    bad = routed.clone()
    bad[1, 4, 1, 0] = 9
    with pytest.raises(
        DataError,
        match=r"'routed_experts': expert id 9 at MoE layer 1 \(row 1, column 4\), but that "
        r"layer of the model has 4 experts",
    ):
        check_routing(routers, bad)
    wide = routed.to(torch.int16)
    wide[0, 2, 0, 1] = -3
    with pytest.raises(DataError, match="expert id -3 at MoE layer 0"):
        check_routing(routers, wide)
    with pytest.raises(DataError, match="records 1 experts per token, MoE layer 0 of the model "):
        check_routing(routers, routed[..., :1])
    with pytest.raises(DataError, match="cover 1 MoE layers, the model has 2"):
        check_routing(routers, routed[:, :, :1])

    # the engine checks the whole batch before its first forward
    engine = _engine(moe_path)
    forwards = []
    handle = engine.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    batch[ROUTED_EXPERTS_KEY] = bad
    with pytest.raises(DataError, match="expert id 9 at MoE layer 1"):
        engine.compute_log_probs(batch)
    with pytest.raises(DataError, match="expert id 9 at MoE layer 1"):
        engine.train_step(batch, _Loss())
    handle.remove()
    assert not forwards


def test_replay_holds_through_the_backward_under_activation_checkpointing(
    moe_path: Path, tmp_path: Path
) -> None:
    """Recorded experts another router chose, replayed in a step with activation
    checkpointing: the backward's recompute runs the recorded experts too (before, it routed
    by the trainer's router: torch's CheckpointError), and the update equals one without
    checkpointing."""
    other = _load(moe_path)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for router in moe_routers(other):
            router.weight.add_(torch.randn(router.weight.shape, generator=gen))
    batch = _batch(other, seed=7)
    batch[ROUTED_EXPERTS_KEY] = _recorded(other.eval(), batch)
    weights = []
    for checkpointing in (False, True):
        engine = FSDPEngine(
            {
                "model_path": str(moe_path),
                "lr": 1e-2,
                "gradient_checkpointing": checkpointing,
                "micro_batch_size": 8,
            }
        )
        metrics = engine.train_step(batch, _Loss(moe_aux_loss_coef=0.1))
        assert metrics["moe/router_agreement"] < 1.0  # the engine's router would differ
        weights.append({n: p.detach().clone() for n, p in engine.model.named_parameters()})
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
