"""Images through the loop, for vision-language models of the Qwen2-VL family.

* :mod:`.images`: decoding a record's image (path, bytes, base64) with a row-naming error;
* :mod:`.vision`: a model folder's image processor and vision tokens -- the ``<image>``
  placeholder expanded to the model's image tokens, pixel patches and grid sizes;
* :mod:`.inputs`: the per-sample features that travel in a batch (``multi_modal_inputs``)
  and the model inputs a forward or a decode needs from them (3-D rotary positions).

A sample's pixel patches and grid sizes stay one per-sample value (a batch non-tensor), so
every transfer protocol, split, pad and micro-batch moves them with their tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_exports

if TYPE_CHECKING:
    from hf_core.multimodal.images import load_image
    from hf_core.multimodal.inputs import (
        IMAGES_KEY,
        MULTI_MODAL_KEY,
        ImageFeatures,
        has_images,
        images_in_prompt_only,
        multimodal_model_inputs,
        next_text_positions,
    )
    from hf_core.multimodal.vision import IMAGE_PLACEHOLDER, VisionProcessor, is_vision_model

__all__ = [
    "IMAGES_KEY",
    "IMAGE_PLACEHOLDER",
    "MULTI_MODAL_KEY",
    "ImageFeatures",
    "VisionProcessor",
    "has_images",
    "images_in_prompt_only",
    "is_vision_model",
    "load_image",
    "multimodal_model_inputs",
    "next_text_positions",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "images": ("load_image",),
        "inputs": (
            "IMAGES_KEY",
            "MULTI_MODAL_KEY",
            "ImageFeatures",
            "has_images",
            "images_in_prompt_only",
            "multimodal_model_inputs",
            "next_text_positions",
        ),
        "vision": ("IMAGE_PLACEHOLDER", "VisionProcessor", "is_vision_model"),
    },
)
