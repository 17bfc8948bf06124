"""``auto`` micro-batch tokens and gradient checkpointing (hf_fsdp.fit) on a one-rank engine.

The process's memory is what decides, so the tests set what the engine sees as available.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_core.errors import MemoryFitError
from hf_fsdp import fit
from hf_fsdp.engine import FSDPEngine
from hf_testing.workers import policy_loss, rollout_batch

VOCAB = 128


def _engine(path: Path, **config: object) -> FSDPEngine:
    return FSDPEngine({"model_path": str(path), "lr": 1e-3, **config})


def _checkpointed_layers(engine: FSDPEngine) -> int:
    return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in engine.model.modules())


def test_roomy_process_keeps_the_default_budget_without_recompute(models: dict) -> None:
    engine = _engine(models["qwen2_tied"])
    assert engine.fit is None  # chosen at the first update, not at build
    metrics = engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=1), policy_loss)
    assert engine.fit is not None
    assert engine.fit.max_tokens == 16384 and not engine.fit.gradient_checkpointing
    assert metrics["fit/micro_batch_tokens"] == 16384.0
    assert metrics["fit/gradient_checkpointing"] == 0.0
    assert 0 < engine.fit.total_bytes <= engine.fit.budget_bytes
    assert _checkpointed_layers(engine) == 0


def test_tight_process_recomputes_and_shrinks_micro_batches(
    models: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(models["qwen2_tied"])
    prints = fit.footprint(engine.config, engine.hf_config, engine.model, 1)
    fixed = sum(prints.peak_bytes(0, False).values()) + prints.loss_bytes(16384)
    # room for ~100 tokens without recompute, fewer than 4096: recompute turns on
    room = fixed + 100 * prints.activation_bytes_per_token(False)
    monkeypatch.setattr(
        fit,
        "device_growth_budget_bytes",
        lambda _device, **_: room - fit.local_weight_bytes(engine.model),
    )
    batch = rollout_batch(16, 5, 6, VOCAB, seed=2)  # one micro-batch of 16 x 11 tokens
    reference = _engine(models["qwen2_tied"], gradient_checkpointing=False)
    expected = reference.train_step(batch, policy_loss)
    metrics = engine.train_step(batch, policy_loss)
    assert engine.fit is not None and engine.fit.gradient_checkpointing
    assert 90 < engine.fit.tokens_without_checkpointing <= 100
    assert 176 <= engine.fit.max_tokens < 16384  # more than the ~100 that fit without
    assert metrics["fit/gradient_checkpointing"] == 1.0
    assert _checkpointed_layers(engine) > 0
    # recomputing changes no number
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
    # an update whose micro-batches fit without recompute runs without it
    small = engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=3), policy_loss)
    assert small["fit/gradient_checkpointing"] == 0.0
    assert _checkpointed_layers(engine) == 0


def test_explicit_settings_are_kept(models: dict) -> None:
    engine = _engine(
        models["qwen2_tied"], max_tokens_per_micro_batch=20, gradient_checkpointing=False
    )
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=3), policy_loss)
    assert engine.fit is None


def test_an_update_that_cannot_fit_says_so(models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(models["qwen2_tied"])
    monkeypatch.setattr(
        fit,
        "device_growth_budget_bytes",
        lambda _device, **_: -fit.local_weight_bytes(engine.model),
    )
    with pytest.raises(
        MemoryFitError, match=r"cannot fit even one sample of \d+ tokens.*MiB.*budget of"
    ):
        engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=4), policy_loss)
    weight = next(engine.model.parameters())  # a plain tensor on one CPU process
    assert torch.isfinite(getattr(weight, "to_local", lambda: weight)()).all()


def test_a_resumed_engine_keeps_the_saved_choice(
    models: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Micro-batch boundaries change summation order: resume must not choose anew."""
    engine = _engine(models["qwen2_tied"])
    monkeypatch.setattr(fit, "device_growth_budget_bytes", lambda _device, **_: 3 * 2**20)
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=5), policy_loss)
    chosen = engine.fit
    assert chosen is not None and chosen.max_tokens < 16384
    engine.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.undo()  # the resumed process has plenty of memory
    resumed = _engine(models["qwen2_tied"])
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.fit is not None
    assert resumed.fit.max_tokens == chosen.max_tokens
    assert resumed.fit.gradient_checkpointing == chosen.gradient_checkpointing
    assert resumed.fit.tokens_without_checkpointing == chosen.tokens_without_checkpointing
