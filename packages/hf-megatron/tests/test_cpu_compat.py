"""The CPU compatibility layer's 16-bit matmuls: float32 products on CPUs without 16-bit
instructions, only where autograd is not recording (megatron's linear autograd functions)."""

from __future__ import annotations

import pytest
import torch

from hf_core.engines import cpu_half
from hf_megatron._cpu_compat import cpu_device_mode
from hf_testing.dispatch import MatmulDtypes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is CPU-only")


@pytest.mark.parametrize("flags", [{"avx2"}, {"avx2", "avx512_bf16"}])
def test_16_bit_matmuls_widen_on_cpus_without_the_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: set[str]
) -> None:
    monkeypatch.setattr(cpu_half, "cpu_flags", lambda: frozenset(flags))
    a = torch.randn(8, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 4, dtype=torch.bfloat16)
    with cpu_device_mode(), MatmulDtypes() as seen, torch.no_grad():
        out = torch.matmul(a, b)
        also = a @ b
    assert out.dtype == also.dtype == torch.bfloat16
    exact = a.double() @ b.double()
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
    expected = torch.float32 if "avx512_bf16" not in flags else torch.bfloat16
    assert seen.dtypes == [expected, expected]


def test_products_autograd_records_keep_torchs_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_half, "cpu_flags", lambda: frozenset({"avx2"}))
    a = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, 4, dtype=torch.bfloat16)
    with cpu_device_mode(), MatmulDtypes() as seen:
        torch.matmul(a, b).sum().backward()
    assert seen.dtypes and set(seen.dtypes) == {torch.bfloat16}
