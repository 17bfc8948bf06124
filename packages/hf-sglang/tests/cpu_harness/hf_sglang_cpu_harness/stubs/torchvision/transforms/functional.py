"""Placeholder ``torchvision.transforms.functional``: the enum, and functions that raise."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("torchvision is a CPU-test placeholder here (hf-sglang harness)")


resize = normalize = to_tensor = pil_to_tensor = _unavailable
