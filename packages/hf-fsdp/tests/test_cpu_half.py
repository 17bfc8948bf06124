"""16-bit products widened to float32 on CPUs without 16-bit instructions (hf_fsdp.cpu_half)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_core import device
from hf_core.algorithms.chunked_head import chunked_head_log_probs_and_entropy
from hf_fsdp import cpu_half
from hf_testing.dispatch import MatmulDtypes

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}


@pytest.fixture
def avx2_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX2)


def test_only_16_bit_cpu_products_on_cpus_without_the_instructions_widen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    half = torch.ones(2, 2, dtype=torch.bfloat16)
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX2)
    assert cpu_half.widens(half, half, None)
    assert device.cpu_lacks(torch.float16)
    assert not cpu_half.widens(half.float(), half.float())
    rows = torch.ones(cpu_half.MIN_ROWS, 2, dtype=torch.bfloat16)
    assert cpu_half.widens_linear(rows, half) and not cpu_half.widens_linear(rows[:-1], half)
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX512_BF16)
    assert not cpu_half.widens(half, half)
    monkeypatch.setattr(device, "cpu_flags", frozenset)  # flags unreadable: torch's kernels
    assert not cpu_half.widens(half, half)


def test_widened_linear_rounds_a_float32_product_once(avx2_only: None) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(48, dtype=torch.bfloat16, requires_grad=True)
    out = cpu_half.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 48)
    exact = F.linear(x.double(), w.double(), b.double())
    # float32 accumulation, one rounding: within one bfloat16 step of the exact product
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    exact_x = grad.double().reshape(-1, 48).mm(w.double()).reshape(3, 5, 64)
    exact_w = grad.double().reshape(-1, 48).t().mm(x.double().reshape(-1, 64))
    assert x.grad is not None and w.grad is not None and b.grad is not None
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), exact_x, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), exact_w, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(b.grad.double(), grad.double().sum((0, 1)), rtol=1e-2, atol=1e-2)


def test_the_products_run_in_float32(avx2_only: None) -> None:
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    with MatmulDtypes() as seen:
        cpu_half.linear(x, w, None).sum().backward()
    assert len(seen.dtypes) == 3 and set(seen.dtypes) == {torch.float32}  # fwd, dx, dw


def test_autograd_keeps_the_16_bit_operands_only(avx2_only: None) -> None:
    """No float32 copy of a weight or activation lives from the forward to the backward."""
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.dtype] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cpu_half.linear(x, w, None).sum().backward()
    assert saved and set(saved) == {torch.bfloat16}


def test_the_chunked_head_widens_and_agrees_with_the_native_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(1)
    hidden = torch.randn(40, 32, dtype=torch.bfloat16)
    weight = torch.randn(300, 32, dtype=torch.bfloat16) * 0.2
    tokens = torch.randint(0, 300, (40,))
    results = []
    for flags in (AVX512_BF16, AVX2):  # native, then widened
        monkeypatch.setattr(device, "cpu_flags", lambda flags=flags: flags)
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        with MatmulDtypes() as seen:
            log_probs, entropy = chunked_head_log_probs_and_entropy(
                h, w, tokens, chunk=16, kernel=cpu_half.head_kernel()
            )
            assert entropy is not None
            (log_probs.sum() + entropy.sum()).backward()
        # the logits and the hidden states' gradient: bfloat16 natively, float32 widened
        expected = torch.float32 if flags is AVX2 else torch.bfloat16
        assert seen.dtypes and seen.dtypes[0] == expected
        results.append((log_probs, entropy, h.grad, w.grad))
    for native, widened in zip(*results, strict=True):
        assert native is not None and widened is not None
        torch.testing.assert_close(widened.float(), native.float(), rtol=2e-2, atol=2e-2)
