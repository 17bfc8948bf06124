"""The CPU compatibility layer's 16-bit products: megatron's linear layers multiply in float32
on CPUs without 16-bit instructions (forward and backward), and only there."""

from __future__ import annotations

import pytest
import torch

from hf_core import device
from hf_megatron._cpu_compat import cpu_device_mode
from hf_testing.dispatch import MatmulDtypes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is CPU-only")


def _megatron_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    return linear_with_grad_accumulation_and_async_allreduce(
        x,
        w,
        None,
        gradient_accumulation_fusion=False,
        allreduce_dgrad=False,
        sequence_parallel=False,
    )


@pytest.mark.parametrize("flags", [{"avx2"}, {"avx2", "avx512_bf16"}])
def test_megatron_linear_products_widen_on_cpus_without_16_bit_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: set[str]
) -> None:
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    with cpu_device_mode():
        with MatmulDtypes() as seen:
            out = _megatron_linear(x, w)
            out.float().square().sum().backward()  # the backward runs outside the mode
    assert out.dtype == torch.bfloat16 and x.grad is not None and w.grad is not None
    exact = x.double() @ w.double().t()
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
    expected = torch.float32 if "avx512_bf16" not in flags else torch.bfloat16
    assert len(seen.dtypes) == 3 and set(seen.dtypes) == {expected}  # forward, dgrad, wgrad


def test_products_autograd_records_keep_torchs_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2"}))
    a = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, 4, dtype=torch.bfloat16)
    with cpu_device_mode(), MatmulDtypes() as seen:
        torch.matmul(a, b).sum().backward()
    assert seen.dtypes and set(seen.dtypes) == {torch.bfloat16}
