"""Placeholder ``torchvision.transforms``: constructing any transform raises."""

from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode


class _Unavailable:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: torchvision is a CPU-test placeholder here (hf-sglang "
            "harness); vision models are not supported in this environment"
        )


class Compose(_Unavailable): ...


class Lambda(_Unavailable): ...


class Resize(_Unavailable): ...


class ToTensor(_Unavailable): ...


class Normalize(_Unavailable): ...


__all__ = [
    "Compose",
    "InterpolationMode",
    "Lambda",
    "Normalize",
    "Resize",
    "ToTensor",
    "functional",
]
