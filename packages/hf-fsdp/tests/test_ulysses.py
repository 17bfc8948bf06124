"""Ulysses layouts and settings, without a process group (the 2-rank equality is in
test_fsdp_dp2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_core.errors import EngineConfigError
from hf_fsdp import ulysses
from hf_testing.workers import rollout_batch

VOCAB = 128


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded-rows"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_response_token_is_predicted_from_its_own_sample(packed: bool, size: int) -> None:
    """The position each response token is read from predicts exactly that token, inside its
    own sample's segment, and rows split evenly over the ranks."""
    batch = rollout_batch(6, 9, 7, VOCAB, seed=3)
    mask = batch["attention_mask"]
    shards = ulysses.lay_out(
        batch["input_ids"], mask, batch["position_ids"], 7, size, packed=packed
    )
    rows, width = shards.input_ids.shape
    assert width % size == 0 and rows == (1 if packed else len(batch))
    real = batch["response_mask"].bool()
    targets = shards.targets.reshape(-1)[shards.predict_from]
    assert torch.equal(targets[real], batch["responses"][real])
    assert shards.padding == rows * width - int(mask.sum())
    starts = torch.tensor([s for s, _ in shards.segments])
    column = shards.predict_from % width
    owner = torch.searchsorted(starts, column, right=True) - 1  # segment of each position
    first = owner[:, :1].expand_as(owner)
    assert torch.equal(owner[real], first[real])  # a sample never reads another's segment
    last = shards.input_ids.reshape(-1)[shards.last_token]
    ends = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    assert torch.equal(last, batch["input_ids"][ends])
    local = [shards.local(shards.input_ids, rank, size) for rank in range(size)]
    assert torch.equal(torch.cat(local, dim=1), shards.input_ids)


def test_heads_that_do_not_split_and_vision_models_are_refused(models: dict, vlm: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    def empty(path: Path, cls: type) -> torch.nn.Module:
        with torch.device("meta"):
            return cls.from_config(AutoConfig.from_pretrained(path))

    model = empty(models["llama"], AutoModelForCausalLM)  # 4 heads, 2 key/value heads
    with pytest.raises(EngineConfigError, match=r"4 attention heads must split evenly"):
        ulysses.enable(model, 3)
    ulysses.enable(model, 4)  # key/value heads repeated to one per rank
    assert model.config._attn_implementation == ulysses.ATTENTION
    with pytest.raises(EngineConfigError, match=r"vision-language model.*parallel.sp: 1"):
        ulysses.enable(empty(vlm["model"], AutoModelForImageTextToText), 2)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded-rows"])
@pytest.mark.parametrize("size", [2, 3])
def test_per_token_tensors_are_laid_out_as_the_tokens(packed: bool, size: int) -> None:
    """lay_out_like (the routing a replayed forward runs, its real-token mask) arranges a
    ``[rows, columns, ...]`` tensor exactly as lay_out arranges ``input_ids``: the token ids
    carried as a trailing dimension come out as the laid-out ids, padding columns hold the
    fill, and the real-token mask marks exactly the laid-out real tokens."""
    batch = rollout_batch(5, 8, 6, VOCAB, seed=4)
    mask = batch["attention_mask"]
    ids = batch["input_ids"]
    shards = ulysses.lay_out(ids, mask, batch["position_ids"], 6, size, packed=packed)
    per_token = torch.stack([ids, ids + 1000], dim=-1)[..., None]  # [rows, columns, 2, 1]
    laid = ulysses.lay_out_like(per_token, mask, size, packed, -1)
    real = ulysses.lay_out_like(mask.bool(), mask, size, packed, False)
    assert laid.shape == (*shards.input_ids.shape, 2, 1)
    assert real.shape == shards.input_ids.shape and int(real.sum()) == int(mask.sum())
    assert torch.equal(laid[..., 0, 0][real], shards.input_ids[real])
    assert torch.equal(laid[..., 1, 0][real], shards.input_ids[real] + 1000)
    assert bool((laid[~real] == -1).all())
    assert int((~real).sum()) == shards.padding
    if packed:  # the real tokens first, then the rounding
        assert bool(real[0, : int(mask.sum())].all())
    else:  # each row's real tokens first
        lengths = mask.sum(-1)
        assert torch.equal(real.sum(-1), lengths)
        assert all(bool(real[i, : int(n)].all()) for i, n in enumerate(lengths))
