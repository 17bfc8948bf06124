"""Configuration validation, the LR schedule, bad model folders and plugin registration."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_fsdp.config import (
    EngineConfigError,
    FSDPEngineConfig,
    TransformersRolloutConfig,
    parse_config,
)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lr": -1.0}, r"lr: got -1\.0: Input should be greater than or equal to 0"),
        ({"betas": (0.9, 1.5)}, r"betas: got .*each beta must be in \[0, 1\)"),
        ({"head": "policy"}, r"head: got 'policy': Input should be 'lm', 'value' or 'score'"),
        (
            {"micro_batch_size": 0},
            r"micro_batch_size: got 0: Input should be greater than or equal",
        ),
        ({"grad_clip": 0.0}, r"grad_clip: got 0\.0: Input should be greater than 0"),
        ({"param_dtype": "fp8"}, r"param_dtype: got 'fp8'"),
        (
            {"learning_rate": 1e-5},
            r"(?s)learning_rate: unknown key \(got 1e-05\).*known keys: .*\blr\b",
        ),
        ({"lr_schedule": "cosine"}, r"lr_schedule='cosine' needs total_steps"),
        ({"warmup_steps": 10, "total_steps": 5}, r"warmup_steps=10 exceeds total_steps=5"),
    ],
)
def test_bad_config_values_name_key_and_value(overrides: dict, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        parse_config(FSDPEngineConfig, {"model_path": "/x", **overrides})


def test_missing_model_path_and_several_problems_reported_together() -> None:
    with pytest.raises(EngineConfigError) as info:
        parse_config(FSDPEngineConfig, {"lr": -2, "eps": 0})
    text = str(info.value)
    assert "model_path: required key is missing" in text
    assert "lr: got -2" in text and "eps: got 0" in text


def test_rollout_config_rejects_unknown_keys() -> None:
    with pytest.raises(EngineConfigError, match=r"temperature: unknown key \(got 1\.0\)"):
        parse_config(TransformersRolloutConfig, {"model_path": "/x", "temperature": 1.0})


def test_valid_config_round_trips() -> None:
    cfg = parse_config(FSDPEngineConfig, {"model_path": "/m", "head": "value", "lr": 3e-4})
    assert cfg.head == "value" and cfg.lr == 3e-4 and cfg.model_path == Path("/m")
    assert parse_config(FSDPEngineConfig, cfg) is cfg


def _cfg(**kw: object) -> FSDPEngineConfig:
    return FSDPEngineConfig(model_path="/m", lr=1.0, **kw)


def test_warmup_is_linear_and_never_zero() -> None:
    cfg = _cfg(warmup_steps=4)
    assert [cfg.lr_factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_and_linear_decay_reach_the_floor() -> None:
    cos = _cfg(lr_schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert cos.lr_factor(2) == pytest.approx(1.0)
    assert cos.lr_factor(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.lr_factor(10) == pytest.approx(0.1)
    assert cos.lr_factor(50) == pytest.approx(0.1)
    lin = _cfg(lr_schedule="linear", total_steps=4)
    assert [lin.lr_factor(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nowhere", "does not exist"),
        (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is not a folder"),
        (lambda p: p, "has no config.json"),
    ],
)
def test_bad_model_folder_is_a_clear_error(tmp_path: Path, make, message: str) -> None:
    from hf_fsdp.engine import FSDPEngine
    from hf_fsdp.rollout import TransformersRolloutEngine

    path = make(tmp_path)
    with pytest.raises(FileNotFoundError, match=message) as info:
        FSDPEngine({"model_path": str(path)})
    assert str(path) in str(info.value)
    with pytest.raises(FileNotFoundError, match=message):
        TransformersRolloutEngine({"model_path": str(path)})


def test_plugin_registers_both_engines() -> None:
    from hf_core import plugins
    from hf_fsdp.plugin import create_rollout_engine, create_training_engine

    plugins.reset()
    assert plugins.get_training_engine("fsdp") is create_training_engine
    assert plugins.get_rollout_engine("transformers") is create_rollout_engine
    info = {b.plugin: b for b in plugins.list_backends()}["fsdp"]
    assert info.distribution == "hf-fsdp"
    assert info.training_engines == ["fsdp"] and info.rollout_engines == ["transformers"]
    # the engine's old name is not an alias: the registry's usual error names what exists
    with pytest.raises(KeyError, match=r"unknown rollout engine 'hf'; available: .*transformers"):
        plugins.get_rollout_engine("hf")


def test_the_retired_hf_class_names_are_refused_naming_the_new_ones() -> None:
    """``hf`` means HybridFlow (issue 58): the engine's classes are ``Transformers*``; the old
    spellings are no aliases, and each failure says what to write instead."""
    from hf_core import plugins
    from hf_core.errors import RenamedError
    from hf_core.imports import UnresolvedReference, resolve
    from hf_core.plugins import hookimpl

    with pytest.raises(
        ImportError,
        match=r"hf_fsdp\.rollout\.HFRolloutEngine was renamed TransformersRolloutEngine "
        r"\('hf' means HybridFlow, not Hugging Face\): use hf_fsdp\.rollout\.Transformers",
    ):
        from hf_fsdp.rollout import HFRolloutEngine  # noqa: F401
    with pytest.raises(
        RenamedError, match=r"HFRolloutConfig was renamed TransformersRolloutConfig"
    ):
        from hf_fsdp.config import HFRolloutConfig  # noqa: F401
    import hf_fsdp.config

    assert not hasattr(hf_fsdp.config, "NoSuchName")  # other names: the usual AttributeError
    # a recipe or plugin naming the old ``module:attr``: the resolver's message names the new
    renamed = r"HFRolloutConfig was renamed TransformersRolloutConfig .*: write "
    with pytest.raises(UnresolvedReference, match=renamed + "'hf_fsdp.config:Transformers"):
        resolve("hf_fsdp.config:HFRolloutConfig", key="settings")

    class OldSpelling:
        @hookimpl
        def register_rollout_engines(self, register):  # type: ignore[no-untyped-def]
            register("old-spelling", object, config="hf_fsdp.config:HFRolloutConfig")

    plugins.reset()
    try:
        plugins.add_plugin(OldSpelling(), "old-spelling")
        with pytest.raises(plugins.PluginLoadError, match=renamed):
            plugins.get_engine_config("rollout", "old-spelling")
    finally:
        plugins.reset()


def test_the_retired_pool_spellings_are_refused_naming_the_leader() -> None:
    """``pool`` means a resource pool (issue 58): the CPU strategy where the host's first rank
    trains for every rank is ``leader``, its decoding switch ``cpu_leader_generation``."""
    with pytest.raises(
        EngineConfigError,
        match=r"cpu_data_parallel: got 'pool': cpu_data_parallel 'pool' was renamed 'leader' "
        r"\('pool' means a resource pool",
    ):
        parse_config(FSDPEngineConfig, {"model_path": "/x", "cpu_data_parallel": "pool"})
    with pytest.raises(
        EngineConfigError,
        match=r"key 'cpu_host_generation' was renamed 'cpu_leader_generation'",
    ):
        parse_config(TransformersRolloutConfig, {"model_path": "/x", "cpu_host_generation": True})
    assert parse_config(FSDPEngineConfig, {"model_path": "/x", "cpu_data_parallel": "leader"})


def test_plugin_factory_validates_config() -> None:
    from hf_fsdp.plugin import create_training_engine

    with pytest.raises(EngineConfigError, match="lr: got -1"):
        create_training_engine(model_path="/x", lr=-1)


def test_the_shared_memory_collectives_declare_their_file_per_node() -> None:
    """The pre-start memory check counts FSDP's shared-memory file (hf_fsdp.cpu_shared_memory)
    once per node when two or more ranks share it, and nothing when they do not use it."""
    from hf_core.engines import DeclaresNodeSharedMemory
    from hf_fsdp.config import SHARED_MEMORY_FILE_BYTES

    settings = FSDPEngineConfig(model_path="m")
    assert isinstance(settings, DeclaresNodeSharedMemory)
    assert (
        settings.node_shared_bytes(2) == settings.node_shared_bytes(8) == SHARED_MEMORY_FILE_BYTES
    )
    assert settings.node_shared_bytes(1) == 0
    gloo = FSDPEngineConfig(model_path="m", cpu_collectives="process_group")
    assert gloo.node_shared_bytes(4) == 0


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"avx2", "fma"}, torch.float32), ({"avx2", "amx_bf16"}, torch.bfloat16)],
    ids=["avx2", "amx"],
)
def test_rollout_dtype_auto_loads_bfloat16_weights_where_the_cpu_computes_them(
    models: dict, monkeypatch: pytest.MonkeyPatch, flags: set[str], expected: torch.dtype
) -> None:
    """The default: half the bytes per decode step where that is native, float32 where
    bfloat16 would be emulated; the engine reports the dtype it resolved to."""
    from hf_core import device
    from hf_fsdp.rollout import TransformersRolloutEngine

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    path = str(models["qwen2_tied"])
    small = TransformersRolloutEngine({"model_path": path})  # a tiny model: float32 on any CPU
    assert small.compute_dtype == torch.float32
    monkeypatch.setattr(device, "CPU_BFLOAT16_MIN_PARAMS", 0)  # as if it were large
    engine = TransformersRolloutEngine({"model_path": path})
    assert engine.compute_dtype == expected
    assert {p.dtype for p in engine.model.parameters()} == {expected}
    pinned = TransformersRolloutEngine({"model_path": path, "dtype": "float32"})
    assert pinned.compute_dtype == torch.float32


def test_the_data_parallel_rule_shards_by_default() -> None:
    """hf_fsdp.data_parallel.choice's rule, which the engine and the pre-start memory check
    share: FSDP2 on GPUs and, by default, on CPU ranks; replicas where asked and they fit;
    the host's leader where asked; one CPU process a plain module."""
    from hf_fsdp.data_parallel.choice import (
        REPLICA_MEMORY_SHARE,
        replica_state_bytes,
        strategy_for,
    )

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    params = 25_000_000
    replicate = FSDPEngineConfig(model_path="m", cpu_data_parallel="replicate")
    state = replica_state_bytes(replicate, params)
    assert state == 16 * params  # float32 weights, gradients, Adam's two moments
    roomy = int(2 * state / REPLICA_MEMORY_SHARE)
    assert strategy_for(replicate, cpu, params, 2, host_bytes=roomy) == "cpu_replicas"
    assert strategy_for(replicate, cpu, params, 2, host_bytes=roomy - 1) == "fsdp2"
    assert strategy_for(replicate, gpu, params, 2, host_bytes=roomy) == "fsdp2"  # GPUs shard
    for mode, two_ranks in (("auto", "fsdp2"), ("fsdp", "fsdp2"), ("leader", "cpu_leader")):
        cfg = FSDPEngineConfig(model_path="m", cpu_data_parallel=mode)
        for size in (1_000_000, params):  # the model's size does not change the default
            assert strategy_for(cfg, cpu, size, 2, host_bytes=roomy) == two_ranks, (mode, size)
            assert strategy_for(cfg, gpu, size, 2, host_bytes=roomy) == "fsdp2"
        one = "fsdp2" if mode == "fsdp" else "cpu_replicas"  # one process: a plain module
        assert strategy_for(cfg, cpu, params, 1, host_bytes=1) == one, mode
    for overrides in (
        {"cpu_collectives": "process_group"},  # both CPU strategies exchange through the file
        {"mixed_precision": "bfloat16"},  # FSDP's policy casts the weights
    ):
        for mode in ("replicate", "leader"):
            other = FSDPEngineConfig(model_path="m", cpu_data_parallel=mode, **overrides)
            assert strategy_for(other, cpu, params, 2, host_bytes=roomy) == "fsdp2"
    led_sp = FSDPEngineConfig(model_path="m", cpu_data_parallel="leader", sequence_parallel_size=2)
    assert strategy_for(led_sp, cpu, params, 2, host_bytes=roomy) == "fsdp2"
    lora = FSDPEngineConfig(model_path="m", lora={"rank": 4})
    assert replica_state_bytes(lora, params) == 4 * params  # frozen weights only


def test_training_state_declared_per_rank_follows_the_data_parallel_rule() -> None:
    small, huge = 1_000_000, 10**12
    default = FSDPEngineConfig(model_path="m", device="cpu")  # auto: FSDP2 shards
    assert default.state_bytes_per_rank(small, 2, True) == 16 * small // 2
    assert default.state_bytes_per_rank(huge, 4, False) == 4 * huge // 4
    assert default.state_bytes_per_rank(small, 1, True) == 16 * small  # one plain module
    replicate = FSDPEngineConfig(model_path="m", device="cpu", cpu_data_parallel="replicate")
    assert replicate.state_bytes_per_rank(small, 2, True) == 16 * small  # replicas: all of it
    assert replicate.state_bytes_per_rank(huge, 2, True) == 16 * huge // 2  # too big: FSDP2
    leader = FSDPEngineConfig(model_path="m", device="cpu", cpu_data_parallel="leader")
    # one state a host and a weight mirror, as equal shares of the ranks
    assert leader.state_bytes_per_rank(huge, 2, True) == (16 + 4) * huge // 2
    assert leader.state_bytes_per_rank(huge, 4, False) == (4 + 4) * huge // 4
    assert leader.state_bytes_per_rank(small, 1, True) == 16 * small  # one process: no mirror
