"""LoRA in core: settings, the peft folder format, the merge, and which sync / reference a
LoRA actor gets (tiny in-memory engines stand in for backends: only core's choices are tested)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.engines import (
    LoRAConfig,
    NamedTensor,
    RolloutEngine,
    SamplingParams,
    ServesAdapters,
    TrainingEngine,
    TrainsAdapters,
    is_adapter_name,
    write_peft_folder,
)
from hf_core.engines.adapters import adapted_module, merge_adapter
from hf_core.roles.adapters import reference_is_actor_base
from hf_core.roles.handover import MemoryHandover
from hf_core.sync import AdapterSync, BroadcastSync, HybridSync, WeightSync, weight_sync_for

A = "model.layers.0.self_attn.q_proj.lora_A.weight"
B = "model.layers.0.self_attn.q_proj.lora_B.weight"
W = "model.layers.0.self_attn.q_proj.weight"


def test_lora_config_defaults_and_errors() -> None:
    config = LoRAConfig()
    assert (config.rank, config.alpha, config.scaling) == (8, 16.0, 2.0)
    assert "q_proj" in config.target_modules and "down_proj" in config.target_modules
    with pytest.raises(ValidationError, match="rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ValidationError, match="dropout"):
        LoRAConfig(dropout=1.0)
    with pytest.raises(ValidationError, match="non-empty"):
        LoRAConfig(target_modules=("q_proj", " "))
    with pytest.raises(ValidationError, match="extra"):
        LoRAConfig(rnak=4)  # type: ignore[call-arg]


def test_adapter_names() -> None:
    assert is_adapter_name(A) and is_adapter_name(B) and not is_adapter_name(W)
    assert adapted_module(A) == "model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        adapted_module(W)


def test_merge_is_w_plus_scaled_b_a() -> None:
    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=gen) for shape in ((6, 5), (2, 5), (6, 2)))
    x = torch.randn(3, 5, generator=gen)
    merged = merge_adapter(w, a, b, scaling=1.5)
    assert torch.allclose(x @ merged.T, x @ w.T + 1.5 * (x @ a.T) @ b.T, atol=1e-6)
    assert merge_adapter(w.double(), a, b, 1.0).dtype == torch.float64


def test_peft_folder_layout(tmp_path: Path) -> None:
    config = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",))
    tensors = [(A, torch.ones(2, 5)), (B, torch.zeros(6, 2))]
    folder = write_peft_folder(tmp_path / "adapter", config, tensors, base_model="/base")
    meta = json.loads((folder / "adapter_config.json").read_text())
    assert meta["peft_type"] == "LORA" and meta["r"] == 2 and meta["lora_alpha"] == 4.0
    assert meta["target_modules"] == ["q_proj"] and meta["base_model_name_or_path"] == "/base"
    from safetensors.torch import load_file

    saved = load_file(folder / "adapter_model.safetensors")
    assert sorted(saved) == sorted(f"base_model.model.{n}" for n, _ in tensors)
    write_peft_folder(folder, config, tensors[:1])  # replaces the folder whole
    assert len(load_file(folder / "adapter_model.safetensors")) == 1
    assert not list(tmp_path.glob(".*"))  # no temporary folder left
    with pytest.raises(ValueError, match="not LoRA adapter tensors"):
        write_peft_folder(tmp_path / "bad", config, [(W, torch.ones(1))])
    with pytest.raises(ValueError, match="no adapter tensors"):
        write_peft_folder(tmp_path / "empty", config, [])


# ------------------------------------------------------------------ sync and reference


class TinyActor(TrainingEngine):
    """Two named tensors as 'the model': enough to see which export a sync uses."""

    def __init__(self, lora: LoRAConfig | None) -> None:
        self.lora = lora

    def compute_log_probs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        raise NotImplementedError

    def train_step(self, batch: Batch, loss_fn: object) -> dict[str, float]:  # type: ignore[override]
        raise NotImplementedError

    def export_weights(self, bucket_bytes: int, plan: object = None) -> Iterator[list[NamedTensor]]:  # type: ignore[override]
        yield [(W, torch.zeros(6, 5))]

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def lora_config(self) -> LoRAConfig | None:
        return self.lora

    def adapters_disabled(self) -> nullcontext[None]:
        return nullcontext()

    def export_adapters(self, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
        yield [(A, torch.zeros(2, 5)), (B, torch.zeros(6, 2))]

    def export_adapter_folder(self, path: Path) -> Path:
        return path


class TinyRollout(RolloutEngine):
    def __init__(self, serves: bool) -> None:
        self.serves = serves
        self.loaded: list[str] = []
        self.adapters: list[str] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        raise NotImplementedError

    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        self.loaded += [name for name, _ in bucket]

    def serves_adapters(self, config: LoRAConfig) -> bool:
        return self.serves

    def load_adapter(self, config: LoRAConfig, tensors: list[NamedTensor]) -> None:
        self.adapters += [name for name, _ in tensors]


def test_lora_actor_syncs_adapters_only_where_they_are_served() -> None:
    lora = LoRAConfig(rank=2)
    actor = TinyActor(lora)
    assert isinstance(actor, TrainsAdapters) and isinstance(TinyRollout(True), ServesAdapters)
    assert isinstance(weight_sync_for(TinyActor(None), TinyRollout(True), **SYNC), HybridSync)

    served = TinyRollout(serves=True)
    sync = weight_sync_for(actor, served, **SYNC)
    assert isinstance(sync, AdapterSync)
    metrics = sync.run()
    assert served.adapters == [A, B] and served.loaded == []
    assert metrics["lora/adapters_only"] == 1.0
    assert metrics["lora/sync_bytes"] == (10 + 12) * 4

    not_served = TinyRollout(serves=False)
    metrics = weight_sync_for(actor, not_served, **SYNC).run()
    assert not_served.loaded == [W] and not_served.adapters == []
    assert metrics["lora/adapters_only"] == 0.0 and metrics["lora/sync_bytes"] == 30 * 4


SYNC = {"bucket_bytes": 1 << 20, "kind": "hybrid", "rank": 0}


def test_the_actor_gets_one_weight_sync_chosen_by_placement_and_engines() -> None:
    """In-process (full or LoRA) or broadcast to a pool (no rollout engine in the process, LoRA
    or not): each is a WeightSync; the trainer runs it the same way."""
    cpu = torch.device("cpu")
    lora = LoRAConfig(rank=2)
    assert isinstance(weight_sync_for(TinyActor(None), TinyRollout(True), **SYNC), WeightSync)
    assert isinstance(weight_sync_for(TinyActor(lora), TinyRollout(True), **SYNC), WeightSync)
    for actor in (TinyActor(None), TinyActor(lora)):
        sync = weight_sync_for(actor, None, device=cpu, **SYNC)
        assert isinstance(sync, BroadcastSync) and isinstance(sync, WeightSync)
    with pytest.raises(ValueError, match="device"):
        weight_sync_for(TinyActor(None), None, **SYNC)
    # a rank other than 0 only exports (the export's collectives need it); rank 0 must join
    other = BroadcastSync(TinyActor(None), bucket_bytes=1 << 20, rank=1, device=cpu)
    assert set(other.run(version=3)) == {"perf/weight_sync_s"}
    sender = BroadcastSync(TinyActor(None), bucket_bytes=1 << 20, rank=0, device=cpu)
    with pytest.raises(RuntimeError, match="not joined"):
        sender.run(version=3)


def test_after_a_sync_only_an_in_process_rollout_engine_takes_the_device() -> None:
    pool = MemoryHandover(TinyActor(None), None, None)
    pool.after_sync()
    assert pool.phase == "training"  # the weights went to a pool: the actor keeps training
    hybrid = MemoryHandover(TinyActor(None), None, TinyRollout(False))
    hybrid.after_sync()
    assert hybrid.phase == "generation"


def _config(tmp_path: Path, reference: dict | None) -> TrainerConfig:
    data = {"model": {"path": str(tmp_path / "base")}, "reward": {"function": "x"}}
    if reference is not None:
        data["reference"] = reference
    return TrainerConfig.model_validate(data)


def test_reference_is_the_lora_actor_base_only_with_the_same_weights(tmp_path: Path) -> None:
    lora, full = TinyActor(LoRAConfig()), TinyActor(None)
    same = _config(tmp_path, {"backend": "fsdp"})
    assert reference_is_actor_base(same, lora)
    assert not reference_is_actor_base(same, full)  # full fine-tuning: a frozen copy is needed
    assert not reference_is_actor_base(_config(tmp_path, None), lora)
    other = _config(tmp_path, {"backend": "fsdp", "model_path": str(tmp_path / "sft")})
    assert not reference_is_actor_base(other, lora)
    other_backend = _config(tmp_path, {"backend": "megatron"})
    assert not reference_is_actor_base(other_backend, lora)
