"""A vision-language model folder's image processor and vision tokens.

Prompts mark each image with :data:`IMAGE_PLACEHOLDER` (``<image>``, the convention of
geometry3k-style datasets).  :class:`VisionProcessor` renders it as the model's own tokens
(``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL), encodes the images with the
folder's image processor (``preprocessor_config.json``), and expands each image-pad token to
as many copies as the image has merged patches -- the format the model's forward and vLLM's
prompt processing both expect.

Checks, each a :class:`~hf_core.errors.DataError` naming the row: an image that does not
decode, an image whose token count exceeds the limit (``max_image_tokens``, by default the
text model's ``max_position_embeddings``), and placeholders that do not match the images.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hf_core.errors import DataError, ModelFolderError
from hf_core.multimodal.images import load_image
from hf_core.multimodal.inputs import ImageFeatures

IMAGE_PLACEHOLDER = "<image>"


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def is_vision_model(config: Any) -> bool:
    """Whether a model config (object or ``config.json`` dict) has a vision tower."""
    return _get(config, "vision_config") is not None


class VisionProcessor:
    """Images -> pixel patches, grid sizes and expanded prompt tokens for one model folder."""

    def __init__(
        self, folder: str | Path, tokenizer: Any, max_image_tokens: int | None = None
    ) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        folder = Path(folder)
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if not is_vision_model(config):
            raise DataError(
                f"{folder}: the data has images but this model has no vision tower "
                "(config.json has no vision_config)"
            )
        try:
            # the slow (PIL) processor: the fast one needs torchvision
            self.image_processor = AutoImageProcessor.from_pretrained(
                str(folder), local_files_only=True, backend="pil"
            )
        except (OSError, ValueError) as e:
            raise ModelFolderError(
                f"{folder}: no usable image processor (preprocessor_config.json): {e}"
            ) from e
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        text = getattr(config, "text_config", config)
        self.max_image_tokens = int(max_image_tokens or text.max_position_embeddings)
        tokens = tokenizer.convert_ids_to_tokens(
            [config.vision_start_token_id, self.image_token_id, config.vision_end_token_id]
        )
        self.placeholder_text = "".join(tokens)
        """What :data:`IMAGE_PLACEHOLDER` becomes in a rendered prompt."""

    def render(self, text: str) -> str:
        """The prompt text with each ``<image>`` as the model's vision tokens."""
        return text.replace(IMAGE_PLACEHOLDER, self.placeholder_text)

    def tokens_per_image(self, grid: torch.Tensor) -> list[int]:
        """Image-pad tokens each image takes: its patches over the merge window."""
        return (grid.prod(-1) // (self.merge * self.merge)).tolist()

    @staticmethod
    def load(images: Sequence[Any], where: str, base: Path | None = None) -> list[Any]:
        """A sample's images decoded (values as :func:`load_image` takes)."""
        return [load_image(value, f"{where}: image {i}", base) for i, value in enumerate(images)]

    def encode(self, decoded: Sequence[Any], where: str) -> ImageFeatures:
        """Pixel patches and grid sizes of a sample's decoded images."""
        if not decoded:
            return ImageFeatures.empty()
        try:
            out = self.image_processor(images=decoded, return_tensors="pt")
        except ValueError as e:  # an aspect ratio or size the processor refuses
            raise DataError(f"{where}: the image processor refuses an image: {e}") from None
        grid = out["image_grid_thw"].long()
        for i, (count, size) in enumerate(zip(self.tokens_per_image(grid), grid, strict=True)):
            if count > self.max_image_tokens:
                t, h, w = size.tolist()
                raise DataError(
                    f"{where}: image {i} ({decoded[i].width}x{decoded[i].height} pixels, grid "
                    f"{t}x{h}x{w}) needs {count} image tokens, over the limit of "
                    f"{self.max_image_tokens} (data.max_image_tokens, or the model's "
                    "max_position_embeddings): resize it or raise the limit"
                )
        return ImageFeatures(out["pixel_values"].float(), grid)

    def expand(self, token_ids: Sequence[int], features: ImageFeatures, where: str) -> list[int]:
        """``token_ids`` with each image-pad token repeated for its image's patches."""
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        images = features.num_images
        if len(slots) != images:
            raise DataError(
                f"{where}: the prompt has {len(slots)} image placeholder(s) "
                f"({IMAGE_PLACEHOLDER!r}) but the record has {images} image(s)"
            )
        out: list[int] = []
        previous = 0
        for slot, count in zip(slots, self.tokens_per_image(features.image_grid_thw), strict=True):
            out += list(token_ids[previous:slot]) + [self.image_token_id] * count
            previous = slot + 1
        return out + list(token_ids[previous:])
