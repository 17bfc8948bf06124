"""CPU linear layers: float32 through oneDNN for calls of 64 rows (tokens) and more, and
16-bit calls widened to float32 on CPUs without instructions for them.

Why: torch's CPU ``linear`` calls MKL's sgemm, which on CPUs it does not tune for (AMD with
AVX-512, the development VM among them) runs its AVX2 kernels, ~85 GFLOP/s per core; oneDNN's
JIT matmul (already inside torch, the kernel torch.compile's CPU backend uses) runs AVX-512
and reaches ~190-200 GFLOP/s on the same float32 GEMMs.  On the actor update this is ~15-20%
of the step (``docs/performance.md``).  The arithmetic stays float32 (no reduced-precision
mode), so results agree with aten's to float32 rounding.

Only calls with at least :data:`MIN_ROWS` rows take the oneDNN path: below that it is slower
than aten on most shapes, and faster from a few dozen rows (docs/performance.md, "Measured
choices"); a weight too large for the caches takes it at any row count
(:data:`LARGE_WEIGHT_BYTES`).  On Intel CPUs, where MKL runs its AVX-512 kernels, only the
large-weight rule applies.  The forward is a oneDNN GEMM, and so is the input gradient on
AVX-512 CPUs; the weight gradient (a reduction over the rows, which oneDNN's linear would need
transposed copies for) stays on aten.

bfloat16 / float16 calls on a CPU that lacks instructions for them (AVX2-only machines) go
to :mod:`hf_fsdp.cpu_half` instead from 8 rows (``cpu_half.MIN_ROWS``): torch would
emulate them at a fraction of float32's speed.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_core import device
from hf_core.engines.row_linear import row_linear
from hf_fsdp import cpu_half

log = logging.getLogger(__name__)

MIN_ROWS = 64
"""Fewer rows than this (decode steps of small batches) stay on aten, unless the weight is
large (:data:`LARGE_WEIGHT_BYTES`)."""
LARGE_WEIGHT_BYTES = 16 * 2**20
"""A weight this large takes oneDNN at any row count.  A decode step reads every weight
from memory (the model outgrows the caches), and MKL's sgemm repacks the whole weight on each
call: a small-batch GEMM over a large weight runs at 2-3 GB/s on aten and 5-10 GB/s on oneDNN
(docs/performance.md, "Measured choices")."""
THREADED_WEIGHT_BYTES = 2 * 2**20
"""With more than one thread, weights from this size take oneDNN at any row count too
(1.1-1.6x on the 25M model's decode GEMMs at 2 threads; at 1 thread aten is as fast or
faster there)."""


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and its fused linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_mm(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``rows @ weight.T + bias`` for a contiguous 2-D ``rows``."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


@functools.cache
def _mkl_tuned_here() -> bool:
    """Whether MKL runs its best kernels on this CPU (Intel's).  There aten's GEMMs match
    oneDNN's on training shapes and its ``grad @ weight`` needs no transposed copy, so only
    the large-weight rule sends calls to oneDNN (docs/performance.md, "Measured choices")."""
    return device.cpu_vendor() == "GenuineIntel"


@functools.cache
def _input_grad_on_onednn() -> bool:
    """Whether the input gradient is faster on oneDNN (with a transposed copy of the weight)
    than on aten's ``grad @ weight``: on AVX-512 CPUs where MKL runs its AVX2 kernels (AMD);
    on an AVX2-only CPU, or where MKL is tuned (:func:`_mkl_tuned_here`), the copy costs more
    than oneDNN saves (docs/performance.md, "Measured choices")."""
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return avx512 and not _mkl_tuned_here()


class _OneDNNKernel:
    """Forward on oneDNN, the input gradient too where that is faster (AVX-512); the weight
    gradient (a reduction over the rows, which oneDNN's linear would need transposed copies
    for) on aten."""

    def forward(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return _onednn_mm(rows, weight, bias)

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if _input_grad_on_onednn():
            return _onednn_mm(grad, weight.t().contiguous(), None)
        return grad.mm(weight)

    def weight_grad(self, grad: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return grad.t().mm(rows)


_ONEDNN = _OneDNNKernel()


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor shard
        and (
            (x.numel() >= MIN_ROWS * x.shape[-1] and not _mkl_tuned_here())
            or _streams_faster(weight)
        )
    )


def _streams_faster(weight: torch.Tensor) -> bool:
    """Whether a small-batch call over ``weight`` is faster on oneDNN (see
    :data:`LARGE_WEIGHT_BYTES`)."""
    size = weight.numel() * weight.element_size()
    limit = LARGE_WEIGHT_BYTES if torch.get_num_threads() == 1 else THREADED_WEIGHT_BYTES
    return size >= limit


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, through oneDNN when the call is large enough to gain from it; 16-bit
    calls on a CPU without instructions for their type in float32 (:mod:`cpu_half`)."""
    if cpu_half.widens_linear(x, weight, bias) and type(weight) in (torch.Tensor, nn.Parameter):
        return cpu_half.linear(x, weight, bias)
    if not _takes_onednn(x, weight):
        return F.linear(x, weight, bias)
    return row_linear(x, weight, bias, _ONEDNN)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose large float32 CPU calls run on oneDNN (same parameters,
    names and state dict; :func:`use_onednn_linear` swaps the class in place)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def use_onednn_linear(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` to :class:`OneDNNLinear`; returns how many
    (0 when this torch has no oneDNN).  Subclasses (LoRA wrappers, quantised layers) keep
    their own forward; their inner plain layers are swapped."""
    if not onednn_linear_available():
        log.info("torch has no oneDNN linear: linear layers stay on aten")
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    return swapped
