"""The shape of a decoder-only transformer: parameter counts, FLOPs per token and KV-cache
bytes, from its HuggingFace ``config.json`` fields.

Sizes, not weights: the auto-mapping planner's cost model, the engines' memory fit and dtype
choice and the pre-start checks all count with it, so it sits below all of them (the planner
adds named presets, :mod:`hf_core.planner.models`).  Counts follow the Llama architecture
(gated MLP with three matrices, grouped-query attention, two RMSNorms per layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypedDict

BF16_BYTES = 2
"""Bytes per weight and per KV-cache element: training and generation run in bf16."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, enough to count parameters, FLOPs and memory.

    ``value_head`` replaces the vocabulary LM head with a ``hidden -> 1`` projection: that is
    what critics, reward and cost models are, and it changes both size and logits memory.
    A mixture of experts (``num_experts > 0``) stores ``num_experts`` gated MLPs of
    ``moe_intermediate_size`` per layer (plus a router and any shared expert) and computes
    ``experts_per_token`` of them per token.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    value_head: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    explicit_head_dim: int = 0
    """A per-head width the config states (Qwen3: 128 on hidden 2048 with 32 heads); 0:
    ``hidden_size // num_heads``."""

    def __post_init__(self) -> None:
        """Reject shapes the formulas below would silently mis-count."""
        for field in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "vocab_size",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"model {self.name!r}: {field} must be an integer >= 1, got {value!r}"
                )
        if not self.explicit_head_dim and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads={self.num_heads} is not divisible by "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Per-head width; K/V projections are ``num_kv_heads * head_dim`` wide."""
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the Q projection (and the O projection's input): all heads."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection under grouped-query attention."""
        return self.num_kv_heads * self.head_dim

    @property
    def is_mixture_of_experts(self) -> bool:
        return self.num_experts > 0

    def _mlp_params(self, experts: int) -> int:
        """One layer's gated MLP weights with ``experts`` experts in it (dense: the MLP)."""
        h = self.hidden_size
        if not self.is_mixture_of_experts:
            return 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size
        shared += h if self.shared_expert_intermediate_size else 0  # its gate
        return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts + shared

    @property
    def layer_matmul_params(self) -> int:
        """Weights one layer stores for matmuls: q, o, k, v and the gated MLP (every expert,
        the router and any shared expert of a mixture)."""
        h = self.hidden_size
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + self._mlp_params(self.num_experts)

    @property
    def layer_active_params(self) -> int:
        """Weights one layer multiplies each token by: its routed experts only."""
        h = self.hidden_size
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + self._mlp_params(self.experts_per_token)

    @property
    def head_params(self) -> int:
        """The output head: a value projection, nothing (tied) or a vocabulary matrix."""
        if self.value_head:
            return self.hidden_size
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: layers (with their two norms), embeddings, head and final norm."""
        h = self.hidden_size
        layers = self.num_layers * (self.layer_matmul_params + 2 * h)
        return layers + self.vocab_size * h + self.head_params + h

    @property
    def matmul_params(self) -> int:
        """Parameters that cost FLOPs per token: layers plus the head (the embedding lookup is
        free; a tied head still multiplies by the embedding matrix)."""
        head = self.hidden_size if self.value_head else self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_active_params + head

    @property
    def weight_bytes(self) -> int:
        """bf16 size of the weights: the ``M`` of Table 2."""
        return BF16_BYTES * self.num_params

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache for one token over all layers (K and V, bf16), before any TP split."""
        return 2 * self.num_layers * self.kv_dim * BF16_BYTES

    @property
    def logits_width(self) -> int:
        """Columns of the output: the vocabulary, or 1 for a value head."""
        return 1 if self.value_head else self.vocab_size

    def forward_flops_per_token(self, attended: float) -> float:
        """Forward FLOPs for one token that attends to ``attended`` keys on average.

        ``2 * matmul_params`` for the dense matmuls plus ``4 * layers * q_dim * attended`` for
        QK^T and AV; a causal pass over ``S`` tokens attends to ``S / 2`` keys on average.
        """
        return 2.0 * self.matmul_params + 4.0 * self.num_layers * self.q_dim * attended

    def with_value_head(self) -> ModelSpec:
        """The same trunk with a scalar head: how a critic or reward model is built from it."""
        if self.value_head:
            return self
        return replace(self, name=f"{self.name}+value", value_head=True)


def from_hf_config(config: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """Build a spec from HuggingFace config fields; missing required keys are named.  A
    vision-language config's language model sits under ``text_config`` (its vision tower,
    a few percent of the parameters, is not counted)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = {**config, **text}
    required = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    )
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"model {name!r}: HF config lacks {missing}")
    return ModelSpec(
        name=str(config.get("_name_or_path") or name),
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        explicit_head_dim=_explicit_head_dim(config),
        **_experts(config),
    )


def _explicit_head_dim(config: Mapping[str, Any]) -> int:
    """The config's ``head_dim`` where it differs from ``hidden_size // heads`` (else 0)."""
    stated = config.get("head_dim")
    derived = config["hidden_size"] // config["num_attention_heads"]
    return int(stated) if stated and int(stated) != derived else 0


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where HF configs give the expert count (Qwen-MoE, Mixtral, DeepSeek)."""


class _ExpertFields(TypedDict, total=False):
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int


def _experts(config: Mapping[str, Any]) -> _ExpertFields:
    """A mixture of experts' fields of :class:`ModelSpec` (none for a dense model).  Mixtral
    names the experts' width ``intermediate_size``; Qwen-MoE ``moe_intermediate_size``."""
    count = next((int(config[k]) for k in EXPERT_COUNT_KEYS if config.get(k)), 0)
    if not count:
        return {}
    return {
        "num_experts": count,
        "experts_per_token": int(config.get("num_experts_per_tok") or 1),
        "moe_intermediate_size": int(
            config.get("moe_intermediate_size") or config["intermediate_size"]
        ),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
    }
