"""Real-shape random models: published parameter counts, config round trips, a cached build."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_testing import real_shapes
from hf_testing.real_shapes import (
    SHAPES,
    cache_key,
    cached_shape_model,
    parameter_count,
    shape_config,
)

# The published totals (model cards: 0.49B, 1.54B, 1.24B); the CI shape keeps the 136.1M
# embedding of the 0.5B model and 2 of its 14.9M layers.
PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b-2layers": 165_960_320,
}
CI_SHAPE = "qwen2.5-0.5b-2layers"


@pytest.mark.parametrize("shape", list(PARAMETERS))
def test_parameter_counts_match_the_published_models(shape: str) -> None:
    assert parameter_count(shape) == PARAMETERS[shape]


def test_the_moe_shapes_keep_the_router_and_count_as_published() -> None:
    """Qwen3-30B-A3B's model card gives 30.5B parameters, 3.3B of them routed per token; the
    bench shape keeps its router and vocabulary at about 300M.  ModelSpec (what the memory
    check and the planner count) agrees with the built models to the per-head norms."""
    from hf_core.model_shapes import from_hf_config

    full, scaled = parameter_count("qwen3-30b-a3b"), parameter_count("qwen3-30b-a3b-scaled")
    assert 30.45e9 < full < 30.55e9
    assert 250e6 < scaled < 350e6
    for shape, built in (("qwen3-30b-a3b", full), ("qwen3-30b-a3b-scaled", scaled)):
        config = shape_config(shape)
        assert (config.num_experts, config.num_experts_per_tok) == (128, 8)
        spec = from_hf_config(config.to_dict())
        assert abs(spec.num_params - built) / built < 1e-4, shape  # q/k norms aside
    active = from_hf_config(shape_config("qwen3-30b-a3b").to_dict()).matmul_params
    assert 3.0e9 < active < 3.6e9  # "A3B": ~3.3B per token, the LM head included


@pytest.mark.parametrize("shape", list(SHAPES))
def test_configs_round_trip_through_autoconfig(tmp_path: Path, shape: str) -> None:
    key = cache_key(shape)
    config = shape_config(shape)
    assert cache_key(shape) == key  # building a config leaves SHAPES (and cache keys) alone
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert {**reloaded.to_dict(), "_name_or_path": ""} == {**config.to_dict(), "_name_or_path": ""}
    spec = SHAPES[shape]
    for key, value in spec.items():
        if key not in ("rope_theta", "rope_scaling"):  # transformers 5 folds them together
            assert getattr(reloaded, key) == value, key
    rope = getattr(reloaded, "rope_parameters", None) or {
        "rope_theta": reloaded.rope_theta,
        **(reloaded.rope_scaling or {}),
    }
    assert rope["rope_theta"] == spec["rope_theta"]
    scaling = spec.get("rope_scaling", {})
    assert {k: rope[k] for k in scaling} == scaling


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real build of the CI shape (~166M parameters, ~15 s, 330 MB in bfloat16)."""
    return cached_shape_model(CI_SHAPE, tmp_path_factory.mktemp("shapes"), dtype="bfloat16")


def test_built_model_loads_and_runs(built: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    vocab = 151936
    assert len(tokenizer) == model.config.vocab_size == vocab
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    enc = tokenizer("reverse 4096:", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], vocab)
    # Ids the tokenizer never produces (a random model samples them) decode, and back.
    assert None not in tokenizer.convert_ids_to_tokens(logits[0].argmax(-1).tolist())
    unused = [vocab - 1, 300]
    text = tokenizer.decode(unused)
    assert text == f"<|placeholder_{vocab - 1}|><|placeholder_300|>"
    assert tokenizer(text)["input_ids"] == unused


def test_rebuilding_hits_the_cache(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: object, **kwargs: object) -> Path:
        raise AssertionError("cache miss")

    monkeypatch.setattr(real_shapes, "build_shape_model", no_build)
    assert cached_shape_model(CI_SHAPE, built.parent, dtype="bfloat16") == built
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temporary folder left
    keys = {cache_key(CI_SHAPE, "bfloat16"), cache_key(CI_SHAPE), cache_key(CI_SHAPE, seed=1)}
    assert len(keys) == 3


def test_failed_build_leaves_no_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_build(shape: str, path: Path, **kwargs: object) -> Path:
        (path / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(real_shapes, "build_shape_model", half_build)
    fail = True
    with pytest.raises(KeyboardInterrupt):
        cached_shape_model(CI_SHAPE, tmp_path)
    assert list(tmp_path.iterdir()) == []

    stale = tmp_path / ".tmp-left-by-a-killed-build"
    stale.mkdir()
    os.utime(stale, (0, 0))
    fail = False
    folder = cached_shape_model(CI_SHAPE, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert (folder / "config.json").exists()
