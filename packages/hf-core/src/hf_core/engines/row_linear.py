"""``rows @ weight.T + bias`` as an autograd function whose three products a kernel supplies.

The CPU linear paths (in hf-fsdp: oneDNN float32, 16-bit products widened to float32) differ
only in how they multiply; the autograd bookkeeping -- what is saved, which gradients are
wanted, the bias gradient -- lives here once.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LinearKernel(Protocol):
    """The three products of a linear layer over 2-D ``rows``."""

    def forward(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``rows @ weight.T + bias``."""
        ...

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad @ weight``, in the rows' dtype."""
        ...

    def weight_grad(self, grad: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``grad.T @ rows``, in the weight's dtype."""
        ...


class RowLinearFunction(torch.autograd.Function):
    """Saves ``rows`` and ``weight`` as given (no copies) and asks ``kernel`` for each
    product the backward needs; the bias gradient is the row sum in the bias's dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: LinearKernel,
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.kernel = kernel
        ctx.bias_dtype = None if bias is None else bias.dtype
        return kernel.forward(rows, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_rows = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_rows = ctx.kernel.input_grad(grad_out, weight)
        if ctx.needs_input_grad[1]:
            grad_weight = ctx.kernel.weight_grad(grad_out, rows)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_out.float().sum(0).to(ctx.bias_dtype)
        return grad_rows, grad_weight, grad_bias, None


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: LinearKernel
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``kernel`` for any leading shape: through
    :class:`RowLinearFunction` when autograd records, straight to the kernel otherwise.
    The result is not a view (FSDP warns on a view returned from a wrapped module)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        out = RowLinearFunction.apply(rows, weight, bias, kernel)
    else:
        out = kernel.forward(rows, weight, bias)
    return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))
