"""The per-sample image features a batch carries, and the model inputs made from them.

A batch from image prompts has the non-tensor :data:`MULTI_MODAL_KEY`: one
:class:`ImageFeatures` per sample (its images' pixel patches and grid sizes; empty for a
text-only sample), and :data:`IMAGES_KEY`: the decoded images, for rollout engines that run
their own image processing (vLLM).  Being per-sample values, they move with their tokens
through every split, pad and transfer.  A forward concatenates a micro-batch's features in
row order (the order the model scatters image embeddings into image-pad tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

MULTI_MODAL_KEY = "multi_modal_inputs"
IMAGES_KEY = "images"


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """One sample's images: ``pixel_values [patches, patch_dim]``, ``image_grid_thw [n, 3]``."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def __eq__(self, other: object) -> bool:  # batch unions compare per-sample values
        return (
            isinstance(other, ImageFeatures)
            and self.pixel_values.shape == other.pixel_values.shape
            and bool(torch.equal(self.pixel_values, other.pixel_values))
            and bool(torch.equal(self.image_grid_thw, other.image_grid_thw))
        )

    __hash__ = None  # type: ignore[assignment]

    @staticmethod
    def empty() -> ImageFeatures:
        return ImageFeatures(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @staticmethod
    def concat(features: Sequence[ImageFeatures]) -> ImageFeatures:
        """The rows' features in row order (text-only rows add nothing)."""
        present = [f for f in features if f.num_images]
        if not present:
            return ImageFeatures.empty()
        return ImageFeatures(
            torch.cat([f.pixel_values for f in present]),
            torch.cat([f.image_grid_thw for f in present]),
        )


def has_images(batch: Any) -> bool:
    """Whether a batch carries image features (:data:`MULTI_MODAL_KEY`)."""
    return MULTI_MODAL_KEY in batch


def multimodal_model_inputs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    features: Sequence[ImageFeatures],
    prompt_width: int | None = None,
) -> dict[str, torch.Tensor]:
    """Keyword inputs of a Qwen2-VL-family forward over rows with images.

    ``position_ids`` are the model's 3-D multimodal rotary positions (``[3, B, T]``; its own
    ``get_rope_index``, which skips padding by ``attention_mask``), so rollout and training
    compute them identically whatever the padding.  ``prompt_width``: only the first columns
    (the prompts) hold images; an image-pad token a policy sampled in its response is text
    there, as it was when it was decoded (run the forward inside
    :func:`images_in_prompt_only`).
    """
    config = model.config
    device = input_ids.device
    image_tokens = (input_ids == int(config.image_token_id)).int()
    if prompt_width is not None:
        image_tokens[:, prompt_width:] = 0
    whole = ImageFeatures.concat(features)
    grid = whole.image_grid_thw.to(device) if whole.num_images else None
    positions, _ = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=image_tokens,
        image_grid_thw=grid,
        attention_mask=attention_mask,
    )
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": positions,
        "mm_token_type_ids": image_tokens,
    }
    if grid is not None:
        dtype = next(model.parameters()).dtype
        inputs["pixel_values"] = whole.pixel_values.to(device, dtype)
        inputs["image_grid_thw"] = grid
    return inputs


@contextmanager
def images_in_prompt_only(model: Any, prompt_width: int) -> Iterator[None]:
    """Within this block the model scatters image features into image-pad tokens of the first
    ``prompt_width`` columns only.

    Why: transformers finds image slots by token id over the whole row, so a response in
    which the policy sampled the image-pad token (a young policy does) would ask for more
    image features than the prompt has.  Decoding fed that token as text; so does the
    training forward, then.
    """
    body = model.model
    find_slots = body.get_placeholder_mask

    def prompt_slots(input_ids: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if input_ids is not None:
            input_ids = input_ids.clone()
            input_ids[:, prompt_width:] = -1
        return find_slots(input_ids, *args, **kwargs)

    body.get_placeholder_mask = prompt_slots
    try:
        yield
    finally:
        del body.get_placeholder_mask


def next_text_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the rotary position of the first token after each prompt (one past the
    largest position of its real tokens; a generated token has the same position on all three
    axes)."""
    real = position_ids.masked_fill(~attention_mask.bool()[None], -1)
    return real.amax(dim=(0, 2)) + 1
