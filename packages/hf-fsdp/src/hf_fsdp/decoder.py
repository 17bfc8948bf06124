"""KV-cached decoding sessions for the transformers rollout engine: transformers' forward, or a lean
decoder for the Llama family that reads the same model's weights.

Why the lean decoder: decoding a small model is bound by per-op overhead, not arithmetic.
transformers' forward spends about a third of a decode step in Python around the tensor ops
(decorators, cache objects, mask building, rotary tables recomputed per call, ``repeat_kv``
copies).  :class:`LlamaFamilyDecoder` runs the same arithmetic with fewer ops:

- q/k/v and gate/up each in one GEMM: the HF parameters become row views of one fused tensor,
  so a weight sync that copies into them in place updates the fused GEMM too (no second copy);
- a KV cache allocated once per generation and written in place;
- rotary tables computed once per generation, applied to q and k together;
- grouped-query attention inside SDPA (``enable_gqa``), with no copy of the keys;
- a prompt prefilled once per group of samples: GRPO-style rollouts repeat each prompt ``n``
  times, so the prefill runs on one row per group and copies the prompt's keys and values
  to the group's other rows (:func:`identical_groups` checks the rows really repeat).

It covers decoder-only models of the Llama shape (``llama``, ``qwen2``, ``mistral`` without a
sliding window; RMSNorm, SiLU MLP, default rotary embedding); :func:`lean_decoder_unsupported`
says why any other model uses :class:`TransformersSession`.  Both give the same logits up to
float rounding (tests/test_decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hf_core.multimodal import ImageFeatures, multimodal_model_inputs, next_text_positions

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


class DecodeSession(Protocol):
    """One generation: the prompt's next-token logits, then one step per sampled token."""

    def prefill(self) -> torch.Tensor:
        """Logits ``[B, V]`` of the token after each (left-padded) prompt."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens [B]`` (the last sampled ones); logits ``[B, V]`` of the next."""
        ...


class KVState(Protocol):
    """What :meth:`LlamaFamilyDecoder.forward` reads and writes: per-layer KV caches, the
    column the next tokens are written at, and rotary tables."""

    cache: list[torch.Tensor]
    length: int
    cos: torch.Tensor
    sin: torch.Tensor


def identical_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, group: int) -> bool:
    """Whether the rows come in runs of ``group`` identical prompts (ids and mask), as
    ``expand_prompts`` lays out ``n`` samples of each prompt."""
    rows = input_ids.shape[0]
    if group <= 1 or rows % group:
        return False
    ids = input_ids.view(rows // group, group, -1)
    mask = attention_mask.view(rows // group, group, -1)
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


def _prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded prompts: 0 at each row's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


class TransformersSession:
    """transformers' own forward with a ``DynamicCache``: any causal LM."""

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
    ) -> None:
        from transformers import DynamicCache

        self.model, self.input_ids = model, input_ids
        rows, self.prompt_len = input_ids.shape
        # One mask for the whole decode: each step attends to a longer prefix of it (a view),
        # instead of concatenating a new column (a new allocation) every step.
        self.mask = torch.ones(
            rows, self.prompt_len + max_new_tokens, dtype=torch.long, device=input_ids.device
        )
        self.mask[:, : self.prompt_len] = attention_mask
        self.positions = _prompt_positions(self.mask[:, : self.prompt_len])
        self.cache = DynamicCache(config=model.config)
        self.fed = 0

    def prefill(self) -> torch.Tensor:
        return self.model(
            input_ids=self.input_ids,
            attention_mask=self.mask[:, : self.prompt_len],
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,  # the LM head runs on the last prompt position only
        ).logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.fed += 1
        return self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask[:, : self.prompt_len + self.fed],
            position_ids=self.positions[:, -1:] + self.fed,
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]


class VisionLanguageSession(TransformersSession):
    """transformers' forward for a vision-language model (Qwen2-VL family): the prefill takes
    the prompts' images and 3-D rotary positions; each generated token's position (the same
    on all three axes) counts on from one past the prompt's largest, as the model's own
    generation does and the training forward recomputes."""

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        features: list[ImageFeatures],
    ) -> None:
        super().__init__(model, input_ids, attention_mask, max_new_tokens)
        self.inputs = multimodal_model_inputs(model, input_ids, attention_mask, features)
        self.next = next_text_positions(self.inputs["position_ids"], attention_mask)

    def prefill(self) -> torch.Tensor:
        return self.model(
            **self.inputs, past_key_values=self.cache, use_cache=True, logits_to_keep=1
        ).logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = (self.next + self.fed).view(1, -1, 1).expand(3, -1, 1)
        self.fed += 1
        return self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask[:, : self.prompt_len + self.fed],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]


# --------------------------------------------------------------------------- lean decoder


def lean_decoder_unsupported(model: nn.Module) -> str | None:
    """Why :class:`LlamaFamilyDecoder` cannot run ``model`` (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (needs silu)"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "sliding-window attention layers"
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        return "sliding-window attention"
    body = getattr(model, "model", None)
    rotary = getattr(body, "rotary_emb", None)
    if getattr(rotary, "rope_type", None) != "default":
        return f"rotary embedding type {getattr(rotary, 'rope_type', None)!r} (needs default)"
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "lm_head is not a linear layer"
    for index, layer in enumerate(getattr(body, "layers", [])):
        attention, mlp = layer.self_attn, layer.mlp
        found = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        found += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        linears = [x for x in found if isinstance(x, nn.Linear)]
        if len(linears) != len(found):
            return f"layer {index}: projections are not plain linear layers (adapters?)"
        if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return f"layer {index}: q/k norms"
        if len({x.bias is None for x in linears[:3]}) != 1 or linears[3].bias is not None:
            return f"layer {index}: attention biases other than all of q/k/v"
        if any(x.bias is not None for x in linears[4:]):
            return f"layer {index}: MLP biases"
    return None


def _fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking ``linears``' rows; each layer's parameters become
    views of it, so in-place copies into them land in the fused tensors."""
    fused: list[torch.Tensor | None] = []
    for attr in ("weight", "bias"):
        parts = [getattr(x, attr) for x in linears]
        if parts[0] is None:
            fused.append(None)
            continue
        whole = torch.cat([p.data for p in parts])
        offset = 0
        for part in parts:
            part.data = whole[offset : offset + part.shape[0]]
            offset += part.shape[0]
        fused.append(whole)
    assert fused[0] is not None
    return fused[0], fused[1]


class _LayerWeights:
    __slots__ = ("down", "gate_up", "input_norm", "out", "post_norm", "qkv", "qkv_bias")

    def __init__(self, layer: nn.Module) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.qkv, self.qkv_bias = _fuse_rows([attention.q_proj, attention.k_proj, attention.v_proj])
        self.out = attention.o_proj.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.gate_up, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj.weight


class LlamaFamilyDecoder:
    """Decoding sessions over a Llama-family model's own weights (see the module docstring).

    Build it after the model reached its device; call :meth:`refresh` after moving the model
    (a move gives every parameter its own storage again, which breaks the fused views).
    """

    def __init__(self, model: nn.Module, linear: Linear = F.linear) -> None:
        reason = lean_decoder_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean decoder cannot run this model: {reason}")
        config = model.config
        self.model, self.linear = model, linear
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)build the fused weight views from the model's current parameters."""
        body: Any = self.model.model
        self.layers = [_LayerWeights(layer) for layer in body.layers]
        self.scaling = float(body.layers[0].self_attn.scaling)

    def open(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        group: int = 1,
    ) -> LlamaFamilySession:
        """A session; ``group``: the rows repeat each prompt this many times (prefilled once
        per group when they really do)."""
        return LlamaFamilySession(self, input_ids, attention_mask, max_new_tokens, group)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' Llama RMSNorm: normalised in float32, scaled in the input dtype."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return weight * normed.to(x.dtype)

    def rotary_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """cos and sin ``[length, head_dim]`` for positions ``0 .. length-1``."""
        rotary: Any = self.model.model.rotary_emb
        positions = torch.arange(length, device=device, dtype=torch.float32)
        angles = torch.outer(positions, rotary.inv_freq.float())
        angles = torch.cat([angles, angles], dim=-1)
        dtype = self.model.model.embed_tokens.weight.dtype
        scale = rotary.attention_scaling
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        session: KVState,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[B, V]`` after the last of ``input_ids [B, T]`` (written at cache slots
        ``session.length .. +T``); ``attention_mask``: bool, broadcastable to ``[B, 1, T, L]``.
        ``session`` is anything with ``cache``, ``length``, ``cos`` and ``sin``."""
        body: Any = self.model.model
        heads, kv_heads, head_dim, linear = self.heads, self.kv_heads, self.head_dim, self.linear
        rows, new = input_ids.shape
        start, end = session.length, session.length + new
        qk_width = (heads + kv_heads) * head_dim
        half = head_dim // 2
        cos = session.cos[positions].unsqueeze(2)  # [B, T, 1, head_dim]
        sin = session.sin[positions].unsqueeze(2)
        hidden = F.embedding(input_ids, body.embed_tokens.weight)
        for weights, cache in zip(self.layers, session.cache, strict=True):
            qkv = linear(self.rms_norm(hidden, weights.input_norm), weights.qkv, weights.qkv_bias)
            qk = qkv[..., :qk_width].view(rows, new, heads + kv_heads, head_dim)
            rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = qk * cos + rotated * sin
            cache[:, start:end, 0] = qk[:, :, heads:]
            cache[:, start:end, 1] = qkv[..., qk_width:].view(rows, new, kv_heads, head_dim)
            attended = F.scaled_dot_product_attention(
                qk[:, :, :heads].transpose(1, 2),
                cache[:, :end, 0].transpose(1, 2),
                cache[:, :end, 1].transpose(1, 2),
                attn_mask=attention_mask,
                scale=self.scaling,
                enable_gqa=True,
            )
            attended = attended.transpose(1, 2).reshape(rows, new, heads * head_dim)
            hidden = hidden + linear(attended, weights.out, None)
            gate_up = linear(self.rms_norm(hidden, weights.post_norm), weights.gate_up, None)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, weights.down, None)
        session.length = end
        last = self.rms_norm(hidden[:, -1], body.norm.weight)
        lm_head: Any = self.model.lm_head
        return linear(last, lm_head.weight, lm_head.bias)


class LlamaFamilySession:
    """One generation on :class:`LlamaFamilyDecoder`: its KV cache and masks."""

    def __init__(
        self,
        decoder: LlamaFamilyDecoder,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        group: int = 1,
    ) -> None:
        self.decoder, self.input_ids = decoder, input_ids
        self.group = group if identical_groups(input_ids, attention_mask, group) else 1
        rows, prompt_len = input_ids.shape
        total = prompt_len + max_new_tokens
        device = input_ids.device
        dtype = decoder.model.model.embed_tokens.weight.dtype
        # [B, slot, key/value, kv head, head_dim]: a step writes one slot of every row
        shape = (rows, total, 2, decoder.kv_heads, decoder.head_dim)
        self.cache = [torch.empty(shape, dtype=dtype, device=device) for _ in decoder.layers]
        self.keys_valid = torch.ones(rows, total, dtype=torch.bool, device=device)
        self.keys_valid[:, :prompt_len] = attention_mask.bool()
        self.positions = _prompt_positions(attention_mask)
        self.cos, self.sin = decoder.rotary_tables(total, device)
        self.length = 0
        self.fed = 0

    def prefill(self) -> torch.Tensor:
        prompt_len = self.input_ids.shape[1]
        device = self.input_ids.device
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
        mask = causal & self.keys_valid[:, None, :prompt_len]
        # a padding position attends to itself: no query row is all masked (NaN in SDPA); the
        # padding's own outputs are never read, and later queries mask its keys
        mask |= torch.eye(prompt_len, dtype=torch.bool, device=device)
        if self.group == 1:
            return self.decoder.forward(self.input_ids, self.positions, self, mask[:, None])
        g = self.group  # one row per group: the first of its copies
        leaders = _GroupLeaders(self)
        logits = self.decoder.forward(
            self.input_ids[::g], self.positions[::g], leaders, mask[::g, None]
        )
        for layer in self.cache:
            copies = layer.view(-1, g, *layer.shape[1:])
            copies[:, 1:, :prompt_len] = copies[:, :1, :prompt_len]
        self.length = leaders.length
        return logits.repeat_interleave(g, dim=0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.fed += 1
        positions = self.positions[:, -1:] + self.fed
        mask = self.keys_valid[:, None, None, : self.length + 1]
        return self.decoder.forward(tokens[:, None], positions, self, mask)


class _GroupLeaders:
    """The first row of each group of a session, for a prefill that runs once per group: its
    cache rows are strided views of the session's, so the forward writes straight into them."""

    def __init__(self, session: LlamaFamilySession) -> None:
        self.cache = [layer[:: session.group] for layer in session.cache]
        self.cos, self.sin = session.cos, session.sin
        self.length = session.length
