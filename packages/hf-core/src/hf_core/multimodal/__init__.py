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

from hf_core.lazy_imports import lazy_package

if TYPE_CHECKING:
    from hf_core.multimodal.images import load_image as load_image
    from hf_core.multimodal.inputs import IMAGES_KEY as IMAGES_KEY
    from hf_core.multimodal.inputs import MULTI_MODAL_KEY as MULTI_MODAL_KEY
    from hf_core.multimodal.inputs import ImageFeatures as ImageFeatures
    from hf_core.multimodal.inputs import has_images as has_images
    from hf_core.multimodal.inputs import images_in_prompt_only as images_in_prompt_only
    from hf_core.multimodal.inputs import multimodal_model_inputs as multimodal_model_inputs
    from hf_core.multimodal.inputs import next_text_positions as next_text_positions
    from hf_core.multimodal.vision import IMAGE_PLACEHOLDER as IMAGE_PLACEHOLDER
    from hf_core.multimodal.vision import VisionProcessor as VisionProcessor
    from hf_core.multimodal.vision import is_vision_model as is_vision_model
# The re-exports above; the typed ones load on first use (hf_core.lazy_imports).
__all__, __getattr__, __dir__ = lazy_package(__name__)
