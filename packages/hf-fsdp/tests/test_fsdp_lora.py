"""LoRA on the FSDP engine (one rank in the test process): the base model with adapters
disabled, adapter-only optimiser state, merged and adapter exports, peft folders, resume.

Expected values come from plain transformers and peft, independently of hf_fsdp's code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_core.batch import Batch
from hf_core.engines import SamplingParams, ServesAdapters, TrainsAdapters
from hf_core.errors import ModelLoadError
from hf_fsdp.config import EngineConfigError
from hf_fsdp.engine import ADAPTER_FOLDER, FSDPEngine
from hf_fsdp.rollout import TransformersRolloutEngine
from hf_testing.workers import policy_loss, rollout_batch, value_loss

VOCAB = 128
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def _lora_engine(path: Path, **kw: object) -> FSDPEngine:
    return FSDPEngine({"model_path": str(path), "lr": 5e-2, "lora": LORA, **kw})


def _trained(path: Path, steps: int = 2) -> FSDPEngine:
    engine = _lora_engine(path)
    for step in range(steps):
        engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=20 + step), policy_loss)
    return engine


def _masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


@pytest.mark.parametrize("folder", ["qwen2_tied", "llama"])
def test_adapters_disabled_is_the_base_model(models: dict, folder: str) -> None:
    path = models[folder]
    engine = _trained(path)
    base = FSDPEngine({"model_path": str(path), "trainable": False})
    batch = rollout_batch(6, 5, 6, VOCAB, seed=3)
    mask = batch["response_mask"]
    expected = base.compute_log_probs(batch, temperature=0.7)["log_probs"]
    with engine.adapters_disabled():
        reference = engine.compute_log_probs(batch, temperature=0.7)["log_probs"]
    policy = engine.compute_log_probs(batch, temperature=0.7)["log_probs"]
    assert _masked_max(reference, expected, mask) <= 1e-6
    assert _masked_max(policy, expected, mask) > 1e-3  # the adapters did train
    # disabling is scoped: the adapters train again afterwards
    assert all(p.requires_grad for n, p in engine.model.named_parameters() if "lora_" in n)


def test_only_adapters_train_and_hold_optimizer_state(models: dict) -> None:
    path = models["llama"]
    engine = _lora_engine(path)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=1), policy_loss)
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=2), policy_loss)
    assert isinstance(engine, TrainsAdapters) and engine.lora_config() is not None
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at zero, so it moved
    optimised = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in engine.model.named_parameters() if "lora_" in n}
    assert optimised == adapters
    # 2 layers x (q, v, up) x (A, B), all fresh from the seed rather than the folder
    assert len(engine.load_report.adapters) == 12
    assert all(".lora_" in n and ".default." not in n for n in engine.load_report.adapters)


def test_value_head_trains_with_lora(models: dict) -> None:
    critic = FSDPEngine(
        {"model_path": str(models["llama"]), "head": "value", "lr": 1e-2, "lora": LORA}
    )
    score = critic.model.score.weight.detach().clone()
    critic.train_step(rollout_batch(4, 5, 6, VOCAB, seed=4), value_loss)
    assert not torch.equal(critic.model.score.weight, score)


def test_lora_config_errors_name_the_key(models: dict) -> None:
    path = str(models["llama"])
    with pytest.raises(EngineConfigError, match=r"lora\.rank"):
        FSDPEngine({"model_path": path, "lora": {"rank": 0}})
    with pytest.raises(EngineConfigError, match="frozen engine"):
        FSDPEngine({"model_path": path, "trainable": False, "lora": {}})
    with pytest.raises(ModelLoadError, match=r"lora.target_modules=\['nope'\]"):
        FSDPEngine({"model_path": path, "lora": {"target_modules": ["nope"]}})


def test_merged_sync_into_hf_rollout_matches_training(models: dict) -> None:
    """After updates and a merged sync, the transformers rollout engine's log-probs are the training
    engine's (the transformers engine serves no adapters: it gets ``W + s B A``)."""
    path = models["qwen2_tied"]
    engine = _trained(path)
    rollout = TransformersRolloutEngine({"model_path": str(path), "dtype": "float32"})
    assert not isinstance(rollout, ServesAdapters)
    names = []
    for bucket in engine.export_weights(1 << 16):
        names += [n for n, _ in bucket]
        rollout.load_weights(bucket)
    rollout.finish_weight_sync()
    assert not any("lora" in n or "base_layer" in n for n in names)
    prompts = rollout_batch(6, 5, 1, VOCAB, seed=8)
    prompts = Batch(
        {"input_ids": prompts["prompts"], "attention_mask": prompts["attention_mask"][:, :5]}
    )
    out = rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    trained = engine.compute_log_probs(out, temperature=1.0)["log_probs"]
    diff = _masked_max(out["rollout_log_probs"], trained, out["response_mask"])
    assert diff <= 1e-4
    with engine.adapters_disabled():
        base = engine.compute_log_probs(out, temperature=1.0)["log_probs"]
    assert _masked_max(out["rollout_log_probs"], base, out["response_mask"]) > 1e-3


def test_peft_folder_and_merged_export_load_in_peft_and_transformers(
    models: dict, tmp_path: Path
) -> None:
    from peft import PeftModel

    path = models["llama"]
    engine = _trained(path)
    batch = rollout_batch(4, 5, 6, VOCAB, seed=9)
    mask = batch["response_mask"]
    expected = engine.compute_log_probs(batch)["log_probs"]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}

    def log_probs(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits = model(**inputs).logits[:, 4:-1]
        return torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]

    adapter = engine.export_adapter_folder(tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter)
    assert _masked_max(log_probs(peft_model), expected, mask) <= 1e-5

    merged = engine.export_hf(tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in n for n in plain.state_dict())
    assert _masked_max(log_probs(plain), expected, mask) <= 1e-5


def test_lora_resumes_exactly(models: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = models["qwen2_tied"]
    first, second = (rollout_batch(4, 5, 6, VOCAB, seed=s) for s in (30, 31))
    run = _lora_engine(path, warmup_steps=2)
    run.train_step(first, policy_loss)
    run.save_checkpoint(tmp_path / "ckpt")
    expected = run.train_step(second, policy_loss)
    resumed = _lora_engine(path, warmup_steps=2)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.train_step(second, policy_loss) == expected
    a = {n: t for b in run.export_adapters(1 << 20) for n, t in b}
    b = {n: t for b in resumed.export_adapters(1 << 20) for n, t in b}
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint also holds the adapters in peft's format
    saved = load_file(tmp_path / "ckpt" / ADAPTER_FOLDER / "adapter_model.safetensors")
    assert len(saved) == len(a) and all(k.startswith("base_model.model.") for k in saved)
