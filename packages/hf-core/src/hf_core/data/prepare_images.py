"""Images of the ``vlm`` prepare format: read from the input, checked, written as files.

A row's images (a path relative to its input file, bytes, a data URL, a ``{bytes, path}``
mapping as Parquet datasets store them, or a decoded image) are all decoded while the input
is read, so a corrupt image stops the conversion naming its row before anything is written.
The question must hold one ``<image>`` placeholder per image.  Given a vision-language model
folder (``--tokenizer``), each image must also fit ``--max-image-tokens`` (default: the
model's ``max_position_embeddings``).  Images are then written as PNG files under
``<output>/images/`` and the record lists them relative to the JSONL, as the trainer reads
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_core.atomic import replaced_atomically
from hf_core.errors import DataError
from hf_core.multimodal.images import load_image

if TYPE_CHECKING:
    from hf_core.multimodal.vision import VisionProcessor

IMAGES_FOLDER = "images"
DECODED = "_decoded_images"
"""Record key holding the decoded images until they are written (never in the output)."""


def row_images(values: Mapping[str, Any], key: str) -> list[Any]:
    """The row's image values: none, one, or a list."""
    value = values.get(key)
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def check_images(
    question: str,
    images: list[Any],
    where: str,
    base: Path | None,
    vision: VisionProcessor | None,
) -> list[Any]:
    """The row's images decoded, after the checks of the module doc."""
    from hf_core.multimodal.vision import IMAGE_PLACEHOLDER  # torch: only for image rows

    decoded = [load_image(value, f"{where}: image {i}", base) for i, value in enumerate(images)]
    placeholders = question.count(IMAGE_PLACEHOLDER)
    if placeholders != len(decoded):
        raise DataError(
            f"{where}: the question has {placeholders} image placeholder(s) "
            f"({IMAGE_PLACEHOLDER!r}) but the row has {len(decoded)} image(s)"
        )
    if vision is not None:
        vision.encode(decoded, where)  # raises when an image needs too many tokens
    return decoded


def write_images(output: Path, name: str, records: list[dict[str, Any]]) -> None:
    """Write each record's decoded images as ``images/<name>_<row>_<i>.png`` (each file
    atomically) and list them in the record's ``images``."""
    folder = output / IMAGES_FOLDER
    for record in records:
        decoded = record.pop(DECODED, None)
        if not decoded:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, image in enumerate(decoded):
            relative = f"{IMAGES_FOLDER}/{name}_{record['source_row']:06d}_{i}.png"
            with replaced_atomically(output / relative) as tmp:
                image.save(tmp, format="PNG")
            paths.append(relative)
        record["images"] = paths
