"""Every GPU-path call hf-fsdp makes into torch, checked against the installed torch.

On the CPU, FSDP's ``CPUOffloadPolicy(pin_memory=True)``, bf16 ``MixedPrecisionPolicy``, a
``cuda`` device mesh and the offload moves never run.  The calls are read from the package's
source and bound against torch's signatures (2.13.0's CPU build here; a GPU machine brings its
own CUDA build of torch), so a torch upgrade that renames or drops one fails here.
"""

from __future__ import annotations

from hf_testing.api_contract import assert_accepted, calls_in

FSDP = "torch.distributed.fsdp."
SOURCES = {
    "hf_fsdp.loading": {
        "CPUOffloadPolicy": f"{FSDP}CPUOffloadPolicy",
        "MixedPrecisionPolicy": f"{FSDP}MixedPrecisionPolicy",
        "OffloadPolicy": f"{FSDP}OffloadPolicy",
        "fully_shard": f"{FSDP}fully_shard",
    },
    "hf_fsdp.offload": {
        "model.to": "torch.nn.Module.to",
        "param.grad.to": "torch.Tensor.to",
        "value.to": "torch.Tensor.to",
    },
    "hf_fsdp.distributed": {"init_device_mesh": "torch.distributed.device_mesh.init_device_mesh"},
    "hf_fsdp.engine": {"module.reshard": f"{FSDP}FSDPModule.reshard"},
    "hf_fsdp.rollout": {"self.model.to": "torch.nn.Module.to"},
}
GPU_ONLY = {
    f"{FSDP}CPUOffloadPolicy",
    f"{FSDP}MixedPrecisionPolicy",
    "torch.nn.Module.to",
    "torch.Tensor.to",
    "torch.distributed.device_mesh.init_device_mesh",
}
"""Calls the scan must find: a refactor that hides them from it fails here, not silently."""


def test_the_scan_finds_the_gpu_only_calls() -> None:
    found = {call.target for module, names in SOURCES.items() for call in calls_in(module, names)}
    assert found >= GPU_ONLY


def test_torch_accepts_every_call() -> None:
    calls = [call for module, names in SOURCES.items() for call in calls_in(module, names)]
    findings = assert_accepted(calls)
    by_signature = {f.call.target for f in findings if f.by_signature}
    assert by_signature >= GPU_ONLY - {"torch.Tensor.to"}  # a C method: existence only
