"""Every call hf-core makes into ``torch.cuda`` and ``torch.distributed``, checked against the
installed torch.

Core's CUDA memory queries (``max_memory_allocated``, ``reset_peak_memory_stats``,
``empty_cache``), the CUDA RNG state, the nccl rendezvous of worker groups and the nccl
weight channel of standalone rollout pools run only on a GPU.  The calls are read from core's
source and bound against torch's signatures, so a torch upgrade that renames or drops one
fails here.  ``ProcessGroupNCCL`` exists only in CUDA builds of torch: on a CPU build that one
call is reported as skipped, not as checked.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_testing.api_contract import ApiCall, assert_accepted, calls_in

TORCH = {"torch.cuda.": "torch.cuda.", "dist.": "torch.distributed."}
MODULES = (
    "hf_core.device",
    "hf_core.rng",
    "hf_core.engines.process_state",
    "hf_core.metrics.perf",
    "hf_core.runtime.worker_process",
    "hf_core.sync.channel",
)
NCCL = "torch.distributed.ProcessGroupNCCL"
GPU_ONLY = {
    "torch.cuda.max_memory_allocated",
    "torch.cuda.reset_peak_memory_stats",
    "torch.cuda.empty_cache",
    "torch.cuda.synchronize",
    "torch.cuda.set_device",
    "torch.cuda.get_rng_state_all",
    "torch.cuda.set_rng_state_all",
    NCCL,
}
"""Calls the scan must find: a refactor that hides them from it fails here, not silently."""


def _calls() -> list[ApiCall]:
    return [call for module in MODULES for call in calls_in(module, TORCH)]


def test_the_scan_finds_the_gpu_only_calls() -> None:
    assert {call.target for call in _calls()} >= GPU_ONLY


def test_torch_accepts_every_call() -> None:
    findings = assert_accepted(call for call in _calls() if call.target != NCCL)
    by_signature = {f.call.target for f in findings if f.by_signature}
    assert by_signature >= GPU_ONLY - {NCCL}


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no nccl")
def test_torch_has_the_nccl_process_group() -> None:
    assert_accepted(call for call in _calls() if call.target == NCCL)
