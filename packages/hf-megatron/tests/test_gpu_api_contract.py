"""Every GPU-path call hf-megatron makes into megatron-core and torch, checked against the
installed versions (megatron-core 0.16.1 here).

On the CPU the Transformer Engine layer spec, ``.cuda()``, the CUDA RNG state in checkpoints
and the offload path's storage resizing never run, and the CPU compatibility layer
(``hf_megatron._cpu_compat``) replaces ``torch.cuda.synchronize`` / ``get_rng_state`` /
``set_rng_state`` with stand-ins once any CPU engine ran in this process.  So the calls are
read from the package's source and bound in a fresh interpreter, against the libraries' own
functions: a megatron-core or torch upgrade that renames or drops one fails here.
"""

from __future__ import annotations

from hf_testing.api_contract import assert_accepted, calls_in

GPT = "megatron.core.models.gpt.GPTModel"
TRACKER = "megatron.core.tensor_parallel.random.CudaRNGStatesTracker"
CUDA = {"torch.cuda.": "torch.cuda."}
STORAGE = "torch.UntypedStorage."
SOURCES = {
    "hf_megatron.checkpoint": {
        **CUDA,
        "tensor_parallel.": "megatron.core.tensor_parallel.",
        "tensor_parallel.get_cuda_rng_tracker().": f"{TRACKER}.",
    },
    "hf_megatron.offload": {
        **CUDA,
        "buf.param_data.untyped_storage().": STORAGE,
        "buf.grad_data.untyped_storage().": STORAGE,
        "buf.param_data.copy_": "torch.Tensor.copy_",
    },
    "hf_megatron.model": {
        "gpt_layer_specs.": "megatron.core.models.gpt.gpt_layer_specs.",
        "TransformerConfig": "megatron.core.transformer.TransformerConfig",
        "GPTModel": GPT,
    },
    "hf_megatron.engine": {"module.cuda": f"{GPT}.cuda"},
    "hf_megatron.rollout": {"model.cuda": f"{GPT}.cuda", "self.model.to": f"{GPT}.to"},
    "hf_megatron.parallel": {"tensor_parallel.": "megatron.core.tensor_parallel."},
}
GPU_ONLY = {
    "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec",
    f"{GPT}.cuda",
    "torch.cuda.get_rng_state",
    "torch.cuda.set_rng_state",
    "torch.cuda.synchronize",
    f"{STORAGE}resize_",
    "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed",
}
"""Calls the scan must find: a refactor that hides them from it fails here, not silently."""


def test_the_scan_finds_the_gpu_only_calls() -> None:
    found = {call.target for module, names in SOURCES.items() for call in calls_in(module, names)}
    assert found >= GPU_ONLY


def test_megatron_and_torch_accept_every_call() -> None:
    calls = [call for module, names in SOURCES.items() for call in calls_in(module, names)]
    findings = assert_accepted(calls, fresh_process=True)
    by_signature = {f.call.target for f in findings if f.by_signature}
    assert by_signature >= GPU_ONLY - {f"{STORAGE}resize_"}  # a C method: existence only
