"""The tiny model builder: deterministic weights, a tokenizer that survives save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_testing.tiny import build_tiny_model, build_tokenizer


@pytest.mark.parametrize("folder", ["qwen2_tied", "llama", "value", "score"])
def test_tokenizer_and_vocab_agree_after_reload(models: dict[str, Path], folder: str) -> None:
    path = models[folder]
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size
    text = "reverse 4096: 6904 and 7+8=15, Ok?"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids == build_tokenizer()(text)["input_ids"]  # same ids as before saving
    assert max(ids) < config.vocab_size
    assert tokenizer.pad_token_id == config.pad_token_id
    assert tokenizer.eos_token_id == config.eos_token_id


def test_qwen2_loads_as_qwen2_tokenizer_without_extra_tokens(models: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models["qwen2_tied"])
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"  # the class docs/platform.md describes
    assert len(tokenizer) == AutoConfig.from_pretrained(models["qwen2_tied"]).vocab_size


def test_same_arguments_give_the_same_weights(tmp_path: Path, models: dict[str, Path]) -> None:
    again = build_tiny_model(tmp_path / "again", "llama", seed=1)
    first = load_file(models["llama"] / "model.safetensors")
    second = load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = load_file(build_tiny_model(tmp_path / "other", "llama", seed=7) / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_tied_and_untied_embeddings(models: dict[str, Path]) -> None:
    tied = AutoModelForCausalLM.from_pretrained(models["qwen2_tied"])
    untied = AutoModelForCausalLM.from_pretrained(models["llama"])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(models["qwen2_tied"] / "model.safetensors")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    n_params = sum(p.numel() for p in untied.parameters())
    assert 10_000 < n_params < 2_000_000


def test_greedy_outputs_differ_across_prompts(models: dict[str, Path]) -> None:
    """initializer_range=0.2 makes a random model prompt-sensitive, so parity tests can fail."""
    path = models["llama"]
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path)
    texts = ["12+34=", "reverse 987:", "hello there", "zz"]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=8, pad_token_id=0)
    rows = {tuple(r) for r in out[:, enc["input_ids"].shape[1] :].tolist()}
    assert len(rows) == 4


def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family must be 'llama', 'qwen2' or 'qwen3_moe'"):
        build_tiny_model(tmp_path, "gpt2")  # type: ignore[arg-type]
