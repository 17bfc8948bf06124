"""hf_core.device: the warning for 16-bit compute a CPU would emulate."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_core import device


@pytest.mark.parametrize(
    ("flags", "dtype", "warned"),
    [
        ({"avx2", "fma"}, torch.bfloat16, True),
        ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, False),
        ({"amx_bf16"}, torch.bfloat16, False),
        ({"avx2"}, torch.float16, True),
        ({"avx2"}, torch.float32, False),
        (set(), torch.bfloat16, False),  # flags unreadable: nothing is claimed
    ],
)
def test_emulated_half_precision_is_named(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    flags: set[str],
    dtype: torch.dtype,
    warned: bool,
) -> None:
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    with caplog.at_level(logging.WARNING, logger="hf_core.device"):
        device.warn_if_emulated_half(torch.device("cpu"), dtype, "the test engine")
    assert ("the test engine computes in" in caplog.text) == warned
    caplog.clear()
    device.warn_if_emulated_half(torch.device("cuda", 0), dtype, "a GPU engine")
    assert caplog.text == ""


def test_this_machines_flags_are_read() -> None:
    flags = device.cpu_flags()
    assert not flags or "fpu" in flags  # /proc/cpuinfo's flags line, when there is one


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma"}, torch.float32),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"amx_bf16"}, torch.bfloat16),
        ({"avx512_fp16"}, torch.float32),  # float16 only: auto stays float32
        (set(), torch.float32),  # flags unreadable: nothing is claimed
    ],
)
def test_a_rollout_dtype_of_auto_is_bfloat16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], expected: torch.dtype
) -> None:
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    assert device.inference_dtype(torch.device("cpu")) == expected
    large = device.CPU_BFLOAT16_MIN_PARAMS
    assert device.inference_dtype(torch.device("cpu"), large) == expected
    # a model whose weights stay in the caches keeps float32 (no bandwidth to save)
    assert device.inference_dtype(torch.device("cpu"), large - 1) == torch.float32
