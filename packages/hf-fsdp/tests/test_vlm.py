"""A vision-language model (tiny Qwen2-VL) through the transformers and FSDP engines.

References are plain transformers (its own ``generate`` and forward, which compute the 3-D
rotary positions themselves), independent of the engines' multimodal code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.multimodal import MULTI_MODAL_KEY, ImageFeatures
from hf_fsdp.engine import FSDPEngine
from hf_fsdp.rollout import TransformersRolloutEngine
from hf_testing.visual_task import image_prompts

ROWS = 4


def _reference_inputs(batch: Batch, rows: slice, image_token: int) -> dict[str, torch.Tensor]:
    """What transformers' processor gives its model: ids, images, image-token types."""
    features = ImageFeatures.concat(list(batch[MULTI_MODAL_KEY][rows]))
    return {
        "input_ids": batch["input_ids"][rows],
        "mm_token_type_ids": (batch["input_ids"][rows] == image_token).int(),
        "attention_mask": batch["attention_mask"][rows],
        "pixel_values": features.pixel_values,
        "image_grid_thw": features.image_grid_thw,
    }


def test_images_of_different_sizes_reach_the_batch(vlm: dict[str, Path]) -> None:
    prompts = image_prompts(vlm["model"], vlm["train"], ROWS)
    grids = {tuple(f.image_grid_thw[0].tolist()) for f in prompts[MULTI_MODAL_KEY]}
    assert len(grids) > 1  # the rows' images differ in size
    model = AutoModelForImageTextToText.from_pretrained(vlm["model"])
    image_token = model.config.image_token_id
    for row, features in enumerate(prompts[MULTI_MODAL_KEY]):
        expected = int(features.image_grid_thw.prod()) // 4  # 2x2 merge
        assert int((prompts["input_ids"][row] == image_token).sum()) == expected


def test_greedy_rollout_equals_hf_generate(vlm: dict[str, Path]) -> None:
    prompts = image_prompts(vlm["model"], vlm["train"], ROWS)
    engine = TransformersRolloutEngine({"model_path": str(vlm["model"]), "dtype": "float32"})
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    model = AutoModelForImageTextToText.from_pretrained(vlm["model"]).eval()
    width = prompts["input_ids"].shape[1]
    for row in range(ROWS):  # one row at a time: generate's own positions, no padding
        inputs = _reference_inputs(prompts, slice(row, row + 1), model.config.image_token_id)
        real = inputs["attention_mask"][0].bool()
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            inputs[key] = inputs[key][:, real]
        expected = model.generate(**inputs, do_sample=False, max_new_tokens=6, eos_token_id=None)
        expected = expected[0, inputs["input_ids"].shape[1] :]
        n = int(out["response_mask"][row].sum())
        assert out["responses"][row, :n].tolist() == expected[:n].tolist(), row
    assert out["input_ids"].shape[1] == width + 6


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_rollout_log_probs_match_the_training_forward(
    vlm: dict[str, Path], temperature: float
) -> None:
    prompts = image_prompts(vlm["model"], vlm["train"], ROWS)
    engine = TransformersRolloutEngine({"model_path": str(vlm["model"]), "dtype": "float32"})
    params = SamplingParams(temperature=temperature, max_new_tokens=8, n=2, seed=3)
    out = engine.generate(prompts, params)
    assert len(out) == 2 * ROWS and MULTI_MODAL_KEY in out
    trainer = FSDPEngine({"model_path": str(vlm["model"]), "trainable": False})
    recomputed = trainer.compute_log_probs(out, temperature=temperature)["log_probs"]
    mask = out["response_mask"].bool()
    assert float((recomputed - out["rollout_log_probs"])[mask].abs().max()) <= 1e-4
    # the images matter: the same tokens without them score differently
    blind = out.select(*[k for k in out.keys() if k != MULTI_MODAL_KEY])
    blind["input_ids"] = blind["input_ids"].masked_fill(
        blind["input_ids"] == trainer.hf_config.image_token_id, 0
    )
    without = trainer.compute_log_probs(blind, temperature=temperature)["log_probs"]
    assert float((without - recomputed)[mask].abs().max()) > 1e-2


def test_weight_sync_covers_the_vision_tower(vlm: dict[str, Path]) -> None:
    """Canonical names are the checkpoint's (``visual.*``, ``model.layers.*``): the training
    engine exports them, the rollout engine loads every one of them."""
    trainer = FSDPEngine({"model_path": str(vlm["model"]), "lr": 1e-2})
    rollout = TransformersRolloutEngine({"model_path": str(vlm["model"]), "dtype": "float32"})
    tensors = [t for bucket in trainer.export_weights(1 << 20) for t in bucket]
    names = [name for name, _ in tensors]
    assert any(n.startswith("visual.") for n in names)
    assert any(n.startswith("model.layers.") for n in names)
    from safetensors import safe_open

    with safe_open(str(vlm["model"] / "model.safetensors"), "pt") as saved:
        assert set(names) == set(saved.keys())
    rollout.load_weights(tensors)
    rollout.finish_weight_sync()
    assert rollout.weight_version == 1
