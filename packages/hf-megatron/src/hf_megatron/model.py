"""Build a megatron-core GPT model for a HF Llama / Qwen2 config, on this rank's stage.

The layer spec is megatron's local (pure PyTorch) one on the CPU, or Transformer Engine's on
a GPU when it is installed (``layer_spec="auto"``).  Weights are never initialised here: the
engine loads them from the HF folder (``perform_initialization=False``), except a value or
score head that the folder does not have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_megatron.weight_mapping import MappingError, ModelDims, NativeParam

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec


def have_transformer_engine() -> bool:
    """Whether Transformer Engine imports (it needs a GPU build)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


def resolve_layer_spec(choice: str, on_gpu: bool) -> str:
    """``auto``: Transformer Engine on a GPU when installed, else the local spec."""
    if choice == "auto":
        return "transformer_engine" if on_gpu and have_transformer_engine() else "local"
    if choice == "transformer_engine" and not (on_gpu and have_transformer_engine()):
        raise RuntimeError("layer_spec='transformer_engine' needs a GPU and transformer-engine")
    return choice


def layer_spec(kind: str, dims: ModelDims | None = None) -> ModuleSpec:
    """megatron's GPT layer spec: ``local`` (PyTorch) or ``transformer_engine``; for a
    mixture of experts, MoE layers with one ``SequentialMLP`` of the rank's local experts
    (no grouped GEMM: it needs CUDA kernels) and Qwen3's per-head q/k norms."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = dims.num_experts if dims is not None and dims.is_moe else None
    qk = bool(dims is not None and dims.qk_norm)
    if experts:
        _define_missing_te_gemm()
    if kind == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk, normalization="RMSNorm"
    )


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1 reads ``moe_utils.te_general_gemm`` in its router's linear, but
    defines it only when Transformer Engine imports (a NameError otherwise, GPU or CPU):
    without Transformer Engine it is None, which selects the plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


MOE_DISPATCHER = "allgather"
"""megatron's token dispatcher for expert parallelism.  ``allgather`` runs over gloo on the
CPU (measured with megatron-core 0.16.1); ``alltoall`` creates a CUDA stream when it is
built (``MoEAlltoAllTokenDispatcher.__init__``) and cannot run without a GPU."""


def moe_settings(dims: ModelDims, ep: int) -> dict[str, Any]:
    """``TransformerConfig`` fields of Qwen3-MoE's router: softmax over the experts' logits,
    top-k, renormalised (megatron: top-k of the logits, then softmax over the k, which is the
    same), no shared experts, no load-balancing loss, no token dropping."""
    if not dims.is_moe:
        if ep > 1:
            raise MappingError(f"ep={ep} needs a mixture-of-experts model")
        return {}
    return {
        "num_moe_experts": dims.num_experts,
        "moe_router_topk": dims.moe_topk,
        "moe_ffn_hidden_size": dims.moe_ffn_size,
        # norm_topk_prob=True: softmax over the top-k logits (the renormalised probabilities);
        # False: softmax over all experts, then top-k (pre-softmax, not renormalised)
        "moe_router_pre_softmax": not dims.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": MOE_DISPATCHER,
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": ep,
    }


def rope_theta(hf_config: Any) -> float:
    """The RoPE base of a HF config (transformers 4 and 5 spell it differently); only the
    default rope type maps onto megatron's rotary embedding."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise MappingError(f"rope_type={rope_type!r} is not supported (only the default RoPE)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def transformer_config(
    hf_config: Any,
    dims: ModelDims,
    *,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    on_gpu: bool,
    sequence_parallel: bool = False,
    ep: int = 1,
) -> TransformerConfig:
    """A ``TransformerConfig`` equivalent to the HF model (no dropout: RL needs the same
    function in every pass; no fused kernels on the CPU)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        qk_layernorm=dims.qk_norm,
        **moe_settings(dims, ep),
    )


class ScalarHead(nn.Module):
    """A value / score head in place of megatron's output layer: ``Linear(hidden, 1)``,
    replicated on every TP rank (its input, the final hidden state, is replicated too)."""

    def __init__(self, hidden_size: int, bias: bool, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None
        # Not initialised here: the engine loads it from the folder or seeds it; its TP
        # attributes (replicated) are set by mark_tensor_parallel like every parameter's.

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return F.linear(hidden, self.weight, self.bias), None


def mark_tensor_parallel(module: nn.Module, params: list[NativeParam]) -> None:
    """Set megatron's TP attributes (``tensor_model_parallel``, ``partition_dim``, ...) on
    every parameter, from the weight mapping.

    megatron sets them only while *initialising* a weight; with ``perform_initialization=
    False`` (we load weights instead) TP-split weights would look replicated, and the grad
    norm would skip them on TP ranks other than 0.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    by_name = {p.name: p for p in params}
    for name, param in module.named_parameters():
        spec = by_name[name]
        if spec.kind == "replicated":
            is_parallel, dim = False, -1
        elif spec.kind == "slice":
            is_parallel, dim = True, int(spec.parts[0].dim or 0)
        else:  # qkv, fc1, vocab: column-parallel
            is_parallel, dim = True, 0
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                delattr(param, attr)
        set_tensor_model_parallel_attributes(param, is_parallel, dim, 1)


def build_gpt(
    hf_config: Any,
    dims: ModelDims,
    tconfig: TransformerConfig,
    spec: ModuleSpec,
    *,
    padded_vocab: int,
    pre_process: bool,
    post_process: bool,
    pg_collection: Any = None,
) -> GPTModel:
    """The megatron GPT model of one pipeline stage (with a scalar head for value/score)."""
    from megatron.core.models.gpt import GPTModel

    kwargs: dict[str, Any] = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    model = GPTModel(
        tconfig,
        spec,
        vocab_size=padded_vocab,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=dims.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        **kwargs,
    )
    if post_process and dims.head != "lm":
        old = model.output_layer
        device = old.weight.device if getattr(old, "weight", None) is not None else "cpu"
        model.output_layer = ScalarHead(
            dims.hidden_size, dims.score_bias, tconfig.params_dtype, device
        )
    return model
