"""The training-process memory estimate and the micro-batch it chooses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, model_validator

from hf_core import plugins
from hf_core.config import TrainerConfig
from hf_core.config.layout import resolve_layout
from hf_core.engines.memory_fit import (
    GIB,
    RUNTIME_BYTES,
    MicroBatchFit,
    TrainingFootprint,
    activation_elements_per_token_layer,
    available_bytes,
    fit_micro_batch,
    node_memory_bytes,
    process_budget_bytes,
)
from hf_core.errors import MemoryFitError
from hf_core.planner.models import from_hf_config
from hf_core.trainer.memory_check import actor_process_fit, check_memory_fit

QWEN_05B_CONFIG = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}
QWEN_05B = from_hf_config(QWEN_05B_CONFIG)


def footprint(ranks: int = 2, **kw: object) -> TrainingFootprint:
    return TrainingFootprint(QWEN_05B, ranks=ranks, param_bytes=4, compute_bytes=4, **kw)  # type: ignore[arg-type]


def test_state_is_sharded_and_counts_adam() -> None:
    assert QWEN_05B.num_params == pytest.approx(494e6, rel=0.01)
    two = footprint(2)
    assert two.state_bytes() == 4 * 4 * QWEN_05B.num_params // 2
    frozen = TrainingFootprint(QWEN_05B, ranks=2, param_bytes=2, compute_bytes=2, trainable=False)
    assert frozen.state_bytes() == 2 * QWEN_05B.num_params // 2
    assert footprint(1).gathered_bytes() == 0
    whole = footprint(2, per_layer_units=False).gathered_bytes()
    assert footprint(2).gathered_bytes() < whole == 2 * 4 * QWEN_05B.num_params  # + gradient
    assert footprint(2, trainable=False).gathered_bytes() * 2 == footprint(2).gathered_bytes()


def test_checkpointing_keeps_layer_inputs_only() -> None:
    fp = footprint()
    per_layer = activation_elements_per_token_layer(QWEN_05B)
    assert fp.activation_bytes_per_token(False) == 4 * 24 * per_layer
    assert fp.activation_bytes_per_token(True) == 4 * (24 * 896 + per_layer)
    assert fp.activation_bytes_per_token(True) * 5 < fp.activation_bytes_per_token(False)


def test_loss_memory_is_bounded_by_the_chunked_head() -> None:
    fp = footprint()
    head_grad = 4 * 151_936 * 896
    assert fp.loss_bytes(16_384) == 2 * fp.logits_budget_bytes + head_grad
    assert fp.loss_bytes(16) == 2 * 4 * 16 * 151_936  # small: full logits are cheaper


def test_fit_prefers_no_checkpointing_when_enough_tokens_fit() -> None:
    fp = footprint()
    roomy = fit_micro_batch(fp, 200 * GIB)
    assert roomy.max_tokens == 16_384 and not roomy.gradient_checkpointing
    assert roomy.total_bytes <= roomy.budget_bytes


def test_fit_turns_checkpointing_on_when_few_tokens_fit() -> None:
    fp = footprint()
    fixed = sum(fp.peak_bytes(0, False).values()) + fp.loss_bytes(16_384)
    budget = fixed + 1000 * fp.activation_bytes_per_token(False)  # ~1000 tokens without
    fit = fit_micro_batch(fp, budget)
    assert fit.gradient_checkpointing
    assert fit.max_tokens > 4096
    assert fit.total_bytes <= budget
    forced = fit_micro_batch(fp, budget, checkpointing=False)
    assert not forced.gradient_checkpointing and 900 < forced.max_tokens <= 1000


def test_a_process_that_cannot_fit_one_sample_is_over_budget() -> None:
    fp = footprint(1)
    fit = fit_micro_batch(fp, 4 * GIB, min_tokens=512)
    assert fit.total_bytes > fit.budget_bytes
    text = fit.describe()
    assert "budget of 4.00 GiB" in text and "state" in text and "activations" in text


def test_resident_memory_leaves_fewer_tokens() -> None:
    fp = footprint()
    base = fit_micro_batch(fp, 8 * GIB, checkpointing=True)
    less = fit_micro_batch(fp, 8 * GIB, resident_bytes=2 * GIB, checkpointing=True)
    assert less.max_tokens < base.max_tokens
    assert less.parts["resident"] == 2 * GIB


def test_machine_memory_is_read() -> None:
    total = node_memory_bytes()
    assert GIB < total < 2**50
    assert 0 < available_bytes() <= total
    assert process_budget_bytes(2, node_bytes=10 * GIB) == (8 * GIB - GIB // 2) // 2


def test_budgets_stay_below_rays_kill_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's memory monitor kills a worker once the node passes 95% used: a budget that
    counted that last 5% passed a 0.5B FSDP -> vLLM float32 run that Ray then killed at
    9.9 GiB a process (2 processes, 23.4 GiB node)."""
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    monkeypatch.delenv("RAY_memory_monitor_refresh_ms", raising=False)
    assert process_budget_bytes(2, node_bytes=20 * GIB) == (20 - 2 - 1) * GIB // 2
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.8")
    assert process_budget_bytes(2, node_bytes=20 * GIB) == (20 - 2 - 4) * GIB // 2
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # the monitor is off
    assert process_budget_bytes(2, node_bytes=20 * GIB) == (20 - 2) * GIB // 2


def _fit(config: TrainerConfig, node_bytes: int | None = None) -> MicroBatchFit:
    """:func:`actor_process_fit` with the layout the config resolves to."""
    return actor_process_fit(config, resolve_layout(config), node_bytes)


def _check_fit(config: TrainerConfig, node_bytes: int | None = None) -> None:
    """:func:`check_memory_fit` with the layout the config resolves to."""
    check_memory_fit(config, resolve_layout(config), node_bytes)


def _trainer_config(tmp_path: Path, model: dict, **sections: dict) -> TrainerConfig:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **model}))
    doc: dict = {"model": {"path": str(folder)}, "reward": {"function": "digits_reverse"}}
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return TrainerConfig.model_validate(doc)


def test_the_actor_process_adds_up_its_roles(tmp_path: Path) -> None:
    alone = _fit(_trainer_config(tmp_path, QWEN_05B_CONFIG), node_bytes=64 * GIB)
    with_ref = _fit(
        _trainer_config(tmp_path, QWEN_05B_CONFIG, reference={"backend": "fsdp"}),
        node_bytes=64 * GIB,
    )
    params = QWEN_05B.num_params
    # the reference's float32 weights, sharded over the default single process
    assert with_ref.parts["resident"] - alone.parts["resident"] == 4 * params
    # the rollout engine's float32 copy and the runtime are resident in the actor's process
    assert alone.parts["resident"] == RUNTIME_BYTES + 4 * params
    assert alone.gradient_checkpointing and alone.total_bytes <= alone.budget_bytes


def test_a_run_that_cannot_fit_is_refused_before_it_starts(tmp_path: Path) -> None:
    config = _trainer_config(tmp_path, QWEN_05B_CONFIG, placement={"processes": 2})
    _check_fit(config, node_bytes=24 * GIB)  # the bench's 0.5B layout fits 24 GiB
    with pytest.raises(MemoryFitError, match=r"cannot fit.*estimated peak .*budget of 2\.80 GiB"):
        _check_fit(config, node_bytes=8 * GIB)
    half = _trainer_config(
        tmp_path,
        QWEN_05B_CONFIG,
        placement={"processes": 2},
        actor={"engine": {"param_dtype": "bfloat16"}},
        rollout={"engine": {"dtype": "bfloat16"}},
    )
    assert _fit(half, 8 * GIB).total_bytes < _fit(config, 8 * GIB).total_bytes


def test_a_teachers_top_k_counts_per_response_token(tmp_path: Path) -> None:
    """Top-k distillation keeps the teacher's k ids (int32 at Qwen's 151,936 tokens) and
    log-probs per response token of the process's share of the batch."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"model_type": "llama", **QWEN_05B_CONFIG}))
    sections = {
        "teacher": {"backend": "fsdp", "model_path": str(teacher)},
        "data": {"batch_size": 8},
        "rollout": {"n": 4, "max_new_tokens": 512},
        "placement": {"processes": 2},
    }
    per_token = _fit(_trainer_config(tmp_path, QWEN_05B_CONFIG, **sections), 64 * GIB)
    top_k = {"distill": {"loss": "jsd", "top_k": 64, "top_k_dtype": "bfloat16"}}
    config = _trainer_config(tmp_path, QWEN_05B_CONFIG, **sections, algorithm=top_k)
    extra = _fit(config, 64 * GIB).parts["resident"] - per_token.parts["resident"]
    assert extra == (8 * 4 // 2) * 512 * 64 * (4 + 2)


def test_a_delta_or_streaming_pool_counts_its_staged_copy(tmp_path: Path) -> None:
    """The staged copy a standalone pool keeps (rollout.sync: delta, or streaming) is one more
    model in the pool's dtype per rollout process, and the sender's mirror one more in the
    actor's rank 0: a 0.5B float32 pool that fits 16 GiB batch-and-full is refused with it."""
    standalone = {"mode": "standalone", "processes": 1, "rollout_processes": 2}
    full = _trainer_config(tmp_path, QWEN_05B_CONFIG, placement=standalone)
    delta = _trainer_config(
        tmp_path, QWEN_05B_CONFIG, placement=standalone, rollout={"sync": "delta"}
    )
    streaming = _trainer_config(
        tmp_path, QWEN_05B_CONFIG, placement=standalone, rollout={"mode": "streaming"}
    )
    params = QWEN_05B.num_params
    assert _fit(delta, 64 * GIB).parts["resident"] - _fit(full, 64 * GIB).parts["resident"] == (
        4 * params
    )
    _check_fit(full, node_bytes=16 * GIB)
    for config in (delta, streaming):
        with pytest.raises(MemoryFitError, match=r"rollout process .*staged weights 1\.8\d GiB"):
            _check_fit(config, node_bytes=16 * GIB)


def test_runs_on_gpus_are_left_to_the_gpu_memory_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node-memory check guards CPU runs: with GPUs (asked for, or ``auto`` on a node that
    has one) the model's memory lives on the devices and the check does not refuse."""
    import torch

    on_gpus = _trainer_config(tmp_path, QWEN_05B_CONFIG, cluster={"use_gpu": True})
    _check_fit(on_gpus, node_bytes=1 * GIB)
    auto = _trainer_config(tmp_path, QWEN_05B_CONFIG)
    assert auto.cluster.use_gpu == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _check_fit(auto, node_bytes=1 * GIB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MemoryFitError):
        _check_fit(auto, node_bytes=1 * GIB)


class _EngineWithOverhead(BaseModel):
    """A rollout engine's settings that declare a KV cache and a runtime of their own."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    kv_gib: int = 1

    def host_overhead_bytes(self) -> int:
        return self.kv_gib * GIB + self.training_overhead_bytes()

    def training_overhead_bytes(self) -> int:
        return 2 * GIB  # the KV cache is handed back while the actor trains


def _registered(kind: str, name: str, settings: type[BaseModel]) -> Iterator[str]:
    """A toy engine ``name`` of ``kind`` ("rollout" / "training") whose settings model is
    ``settings``, registered for one test."""
    plugins.reset()
    registry = plugins.registry()
    getattr(registry, f"{kind}_engines").add(name, dict, owner="test")
    getattr(registry, f"{kind}_engine_configs").add(name, settings, owner="test")
    yield name
    plugins.reset()


@pytest.fixture
def overhead_engine() -> Iterator[str]:
    yield from _registered("rollout", "heavy-toy", _EngineWithOverhead)


def test_the_rollout_engines_declared_overhead_counts_before_the_run_starts(
    tmp_path: Path, overhead_engine: str
) -> None:
    """What the engine holds beyond its weights (vLLM on the CPU: KV cache, a packed LM head
    and its own runtime) is part of the pre-start estimate, read from the validated settings
    block; without it a run passed the check and was killed while its engines were being
    built.  A KV cache handed back during training counts while generating only."""
    plain = _trainer_config(tmp_path, QWEN_05B_CONFIG, placement={"processes": 2})
    heavy = _trainer_config(
        tmp_path,
        QWEN_05B_CONFIG,
        placement={"processes": 2},
        rollout={"backend": overhead_engine, "engine": {"kv_gib": 1}},
    )
    added = _fit(heavy, 24 * GIB).parts["resident"]
    assert added - _fit(plain, 24 * GIB).parts["resident"] == 2 * GIB
    _check_fit(plain, node_bytes=20 * GIB)
    with pytest.raises(MemoryFitError, match="cannot fit this machine: while training"):
        _check_fit(heavy, node_bytes=20 * GIB)
    huge_kv = _trainer_config(
        tmp_path,
        QWEN_05B_CONFIG,
        placement={"processes": 2},
        rollout={"backend": overhead_engine, "engine": {"kv_gib": 9}},
    )
    _fit(huge_kv, 24 * GIB)  # the update alone fits ...
    _check_fit(heavy, node_bytes=24 * GIB)
    with pytest.raises(MemoryFitError, match="while generating"):  # ... generation does not
        _check_fit(huge_kv, node_bytes=24 * GIB)


def test_lora_counts_the_frozen_base_weights_once(tmp_path: Path) -> None:
    """A LoRA actor holds its frozen, sharded base weights and a tiny trained state: the
    estimate counts those weights once (as the footprint's state), not again as resident."""
    lora = _trainer_config(
        tmp_path,
        QWEN_05B_CONFIG,
        placement={"processes": 2},
        actor={"engine": {"lora": {"rank": 16, "alpha": 32}}},
    )
    fit = _fit(lora, 24 * GIB)
    frozen = 4 * QWEN_05B.num_params // 2
    assert fit.parts["state"] == frozen
    assert fit.parts["resident"] == RUNTIME_BYTES + 4 * QWEN_05B.num_params  # + rollout copy


class _MasterWeightsEngine(BaseModel):
    """A training engine's settings that keep 18 bytes a parameter when trained (16-bit
    weights, float32 gradients, master weights and Adam moments), 2 when frozen."""

    model_config = ConfigDict(extra="allow")
    trainable: bool = True
    lora: dict | None = None

    @model_validator(mode="after")
    def _adapters_need_training(self) -> _MasterWeightsEngine:
        if self.lora is not None and not self.trainable:  # as hf-fsdp's settings say
            raise ValueError("lora is set on a frozen engine")
        return self

    def state_bytes_per_rank(self, num_params: int, ranks: int, trainable: bool) -> int:
        return (18 if trainable else 2) * num_params // ranks


@pytest.fixture
def master_weights_engine() -> Iterator[str]:
    yield from _registered("training", "master-toy", _MasterWeightsEngine)


def test_the_training_engines_declared_state_replaces_the_default_count(
    tmp_path: Path, master_weights_engine: str
) -> None:
    """An engine that keeps float32 master weights for 16-bit parameters (megatron) holds more
    than four 16-bit copies; the estimate takes the settings' own count for the actor's state
    and the reference's weights.  Without it a megatron bfloat16 run passed the check at 8.6
    GiB and resumed at 10.3 GiB."""
    sections = {
        "placement": {"processes": 2},
        "actor": {"backend": master_weights_engine, "engine": {"param_dtype": "bfloat16"}},
        "reference": {"backend": master_weights_engine},
    }
    fit = _fit(_trainer_config(tmp_path, QWEN_05B_CONFIG, **sections), 24 * GIB)
    params = QWEN_05B.num_params
    assert fit.parts["state"] == 18 * params // 2
    default = _fit(
        _trainer_config(
            tmp_path, QWEN_05B_CONFIG, placement={"processes": 2}, reference={"backend": "fsdp"},
            actor={"engine": {"param_dtype": "bfloat16"}},
        ),
        24 * GIB,
    )  # fmt: skip
    assert default.parts["state"] == 4 * 2 * params // 2
    # the reference's frozen weights: the declared 2 bytes, against fsdp's float32 default
    assert default.parts["resident"] - fit.parts["resident"] == (4 - 2) * params // 2


def test_a_lora_actor_declares_its_frozen_base_weights(
    tmp_path: Path, master_weights_engine: str
) -> None:
    """LoRA: the engine is trained (its settings validate as such) but its base weights are
    frozen, so the declared count is the weights-only one."""
    engine = {"param_dtype": "bfloat16", "lora": {"rank": 8}}
    lora = {"backend": master_weights_engine, "engine": engine}
    config = _trainer_config(tmp_path, QWEN_05B_CONFIG, placement={"processes": 2}, actor=lora)
    assert _fit(config, 24 * GIB).parts["state"] == 2 * QWEN_05B.num_params // 2


class _NodeSharedEngine(BaseModel):
    """A training engine's settings whose ranks on a node share a 300 MiB file."""

    model_config = ConfigDict(extra="allow")

    def node_shared_bytes(self, ranks_per_node: int) -> int:
        return 300 * 2**20 if ranks_per_node > 1 else 0


@pytest.fixture
def node_shared_engine() -> Iterator[str]:
    yield from _registered("training", "shared-toy", _NodeSharedEngine)


def test_memory_the_ranks_of_a_node_share_is_split_among_them(
    tmp_path: Path, node_shared_engine: str
) -> None:
    """What the actor's ranks on a node hold together (FSDP's shared-memory file for its CPU
    collectives) counts once per node: each of the node's processes carries its share."""

    def resident(processes: int) -> int:
        config = _trainer_config(
            tmp_path, QWEN_05B_CONFIG, placement={"processes": processes},
            actor={"backend": node_shared_engine},
        )  # fmt: skip
        return _fit(config, 64 * GIB).parts["resident"]

    # the rest of a process's resident memory does not depend on the rank count
    assert resident(2) - resident(1) == 150 * 2**20
    assert resident(4) - resident(1) == 75 * 2**20
