"""16-bit matrix products on CPUs that have no instructions for them, done in float32.

CPU-only, and only where the CPU lacks the instructions: :func:`widens` is false on every GPU
tensor and on CPUs with AVX512-BF16 / AMX-BF16 (bfloat16) or AVX512-FP16 (float16), where
torch's own kernels are the fast path.

Why: without those instructions torch emulates bfloat16 GEMMs, several times slower than the
same float32 linear layer on an AVX2-only CPU, and a bfloat16 update an order of magnitude
slower than in float32 (docs/performance.md, "Measured choices").
Here each operand is widened to float32 (exact), multiplied with float32 accumulation and
the result rounded once to the 16-bit type -- the contract of a GPU's tensor cores and of
CPUs with bfloat16 instructions, which also accumulate in float32 -- at float32 speed.
Autograd keeps the 16-bit operands (no float32 copies live across the step), and the
backward's products are widened the same way.  The chunked LM head's products
(:func:`head_kernel`, core's :data:`~hf_core.algorithms.chunked_head.HeadKernel` hook) widen
the head weight once per pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_core import device
from hf_core.algorithms.chunked_head import HeadKernel, HeadLinear, HeadProducts, LinearProducts
from hf_core.engines.row_linear import row_linear


def widens(*tensors: torch.Tensor | None) -> bool:
    """Whether a product of these tensors is widened here: all on the CPU, the first a
    16-bit float this CPU has no instructions for."""
    first = tensors[0]
    assert first is not None
    return all(t is None or t.device.type == "cpu" for t in tensors) and device.cpu_lacks(
        first.dtype
    )


MIN_ROWS = 8
"""Fewer rows than this (decode steps of small batches) keep torch's kernel: widening costs a
float32 copy of the weight per call, and torch's emulated product grows with the rows, so
widening wins from about this many rows (docs/performance.md, "Measured choices")."""


def widens_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear(x, weight, bias)`` is widened: :func:`widens`, with at least
    :data:`MIN_ROWS` rows."""
    return widens(x, weight, bias) and x.numel() >= MIN_ROWS * x.shape[-1]


def _wide(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float()


class _WidenedKernel:
    """The three products of a linear layer, each widened to float32 and rounded once."""

    def forward(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(rows.float(), weight.float(), _wide(bias)).to(rows.dtype)

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grad.float().mm(weight.float()).to(grad.dtype)

    def weight_grad(self, grad: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return grad.float().t().mm(rows.float()).to(rows.dtype)


_WIDENED = _WidenedKernel()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in ``x``'s 16-bit dtype, computed in float32 (see the module)."""
    return row_linear(x, weight, bias, _WIDENED)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` of 16-bit tensors outside autograd, in float32, rounded once
    to ``a``'s dtype."""
    return torch.matmul(a.float(), b.float()).to(a.dtype)


class WidenedHeadProducts:
    """The chunked head's products with its 16-bit weight widened to float32 once per pass,
    each product rounded to the compute dtype as a native one would be."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.wide = weight.float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float().mm(self.wide.t()).to(hidden.dtype)

    def input_grad(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(grad.float().mm(self.wide))


def head_kernel(linear: HeadLinear = F.linear) -> HeadKernel:
    """The chunked head's products: widened where this CPU lacks the hidden states' 16-bit
    type (:func:`widens`), else the logits through ``linear`` (the engine's kernel)."""

    def kernel(hidden: torch.Tensor, weight: torch.Tensor) -> HeadProducts:
        if widens(hidden, weight):
            return WidenedHeadProducts(weight)
        return LinearProducts(weight, linear)

    return kernel
