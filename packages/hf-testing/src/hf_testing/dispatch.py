"""Which dtypes a piece of code's matrix products actually ran in, seen at torch's dispatcher.

For tests of numerics paths that must change *how* a product runs (widened 16-bit products on
CPUs without 16-bit instructions) while results stay within rounding of the plain path: the
result alone cannot show that the path was taken.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}
_WITH_BIAS_FIRST = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of the first operand of every mm / addmm / bmm / baddbmm run inside
    the ``with`` block (forward and backward) in :attr:`dtypes`."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in _MATMULS:
            operand = args[1] if func in _WITH_BIAS_FIRST else args[0]
            self.dtypes.append(operand.dtype)
        return func(*args, **(kwargs or {}))
