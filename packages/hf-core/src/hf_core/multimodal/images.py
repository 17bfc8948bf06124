"""A record's image as a PIL image, or a :class:`~hf_core.errors.DataError` naming the row.

An image value may be a path (relative paths resolve against the data file's folder), raw
bytes, a ``data:image/...;base64,`` URL, or the ``{"bytes": ..., "path": ...}`` mapping that
Parquet datasets (geometry3k and the like) store.  Every image is fully decoded (``load``),
so a truncated or corrupt file fails here, at data preparation or dataset build, not in the
middle of a rollout.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_core.errors import DataError


def _image_bytes(value: Any, base: Path | None, where: str) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return _image_bytes(value["bytes"], base, where)
        if value.get("path"):
            return _image_bytes(str(value["path"]), base, where)
        raise DataError(f"{where}: an image mapping needs 'bytes' or 'path', got {sorted(value)}")
    if isinstance(value, str):
        if value.startswith("data:"):
            try:
                return base64.b64decode(value.split(",", 1)[1], validate=True)
            except (IndexError, binascii.Error) as e:
                raise DataError(f"{where}: malformed base64 image data URL ({e})") from None
        path = Path(value).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise DataError(f"{where}: image file {path} does not exist")
        return path.read_bytes()
    raise DataError(
        f"{where}: an image must be a path, bytes, a data URL or a {{bytes, path}} mapping, "
        f"got {type(value).__name__}"
    )


def load_image(value: Any, where: str, base: Path | None = None) -> Any:
    """The decoded RGB image ``value`` holds (see the module doc); ``where`` names the row."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    data = _image_bytes(value, base, where)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: the image cannot be decoded ({type(e).__name__}: {e})") from None
    return image.convert("RGB")
