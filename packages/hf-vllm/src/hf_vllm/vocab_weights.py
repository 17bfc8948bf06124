"""Vocabulary-sized tensors loaded straight into the engine's parameters.

vLLM's layerwise ``reload_weights`` rebuilds a layer before loading into it and copies the
result back into the original storage.  For the input embedding and the LM head (vocabulary x
hidden: 0.54 GB at the Qwen2.5-0.5B shape in float32) that is a second whole copy during
every weight sync, beside the training engine's gathered tensor.  Their loaders only copy this
rank's vocabulary rows into the parameter, and their only post-processing is the CPU GEMM
packing of a head, so they are loaded here with the parameter's own loader; a head is then
re-packed (:func:`repack_heads`) after its old packed copy is dropped, so the two never
coexist.  Measured at the 0.5B shape: a sync's peak fell by about 1 GB a process
(docs/real_sizes.md).

Both functions run on the vLLM worker (``collective_rpc``), so each TP rank loads its own
vocabulary shard.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_core.engines import NamedTensor


def vocab_parameter_names(worker: Any) -> list[str]:
    """The model's parameters that belong to vocabulary embeddings or LM heads."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    return sorted(
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules()
        if isinstance(module, VocabParallelEmbedding)
        for name, _ in module.named_parameters(recurse=False)
    )


@torch.no_grad()
def load_vocab_in_place(worker: Any, weights: list[NamedTensor]) -> list[str]:
    """Copy whole canonical vocabulary tensors into their parameters (this rank's rows, by
    the parameter's own loader); returns the modules loaded."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    model = worker.model_runner.get_model()
    loaded = []
    for name, tensor in weights:
        module_name, _, param_name = name.rpartition(".")
        param = model.get_submodule(module_name).get_parameter(param_name)
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.append(module_name)
    return loaded


def repack_heads(worker: Any, module_names: list[str]) -> list[str]:
    """Re-run the weight post-processing of the LM heads among ``module_names`` (on CPU: the
    GEMM packing of the head's tensor), dropping the old packed copy first; returns the
    heads processed.  Other modules are skipped (an input embedding needs none)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.get_model()
    done = []
    for name in module_names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        method = getattr(module, "quant_method", None)
        if not isinstance(module, ParallelLMHead) or method is None:
            continue
        if hasattr(module, "cpu_linear"):
            module.cpu_linear = None  # the old packed copy goes before the new one is made
        method.process_weights_after_loading(module)
        done.append(name)
    return done
