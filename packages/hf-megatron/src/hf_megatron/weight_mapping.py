"""HF (canonical) <-> megatron-core weights, per tensor-parallel rank and pipeline stage.

Pure torch, no megatron import: every rank can compute every other rank's slices, which the
reshard relies on.  Conventions of megatron's GPT model (local or Transformer Engine spec):

* ``linear_qkv`` fuses q, k and v *interleaved per KV group*: for each query group ``g`` the
  rows are ``[q heads of g (num_heads / num_kv_heads of them); k_g; v_g]``, each head
  ``head_dim`` rows.  A TP rank holds ``num_kv_heads / tp`` whole groups, so its canonical
  q, k and v rows are each one contiguous block.  Qwen2's q/k/v biases follow the same rule.
* ``linear_fc1`` fuses ``[gate; up]`` per TP rank (each rank: its gate rows, then its up rows).
* ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) are split along columns (dim 1).
* Embedding and output layer are split along the vocabulary, padded to a multiple of
  ``make_vocab_size_divisible_by * tp``; padded rows are zero and are dropped on export.
* Norms (and a value/score head) are replicated on every TP rank.
* Qwen3-MoE (every layer sparse): ``q_layernorm`` / ``k_layernorm`` are Qwen3's per-head
  ``q_norm`` / ``k_norm``; ``mlp.router.weight`` is ``mlp.gate.weight``; local expert ``j`` of
  expert-parallel rank ``e`` (``mlp.experts.local_experts.j``) is global expert
  ``e * experts / ep + j`` of the checkpoint (``mlp.experts.E.{gate,up,down}_proj``), with
  ``linear_fc1`` = ``[gate; up]`` and TP splits as a dense MLP's (expert TP = TP).
* Layers are numbered locally per pipeline stage (``decoder.layers.0`` is layer
  ``stage * layers_per_stage`` of the model).
* With tied embeddings and ``pp > 1`` the last stage holds a copy of the embedding as
  ``output_layer.weight``; it loads from ``model.embed_tokens.weight`` and is not exported
  (the canonical owner is the embedding, as ``save_pretrained`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hf_core.engines import CanonicalSlice, HeadKind, NamedTensor, WeightMapping

Fetch = Callable[[str, int | None, int, int], torch.Tensor]
"""``fetch(hf_name, dim, start, stop)``: rows/cols ``[start, stop)`` of a canonical tensor along
``dim``, or the whole tensor when ``dim`` is None."""

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "LlamaForTokenClassification": ("llama", "value"),
    "Qwen2ForTokenClassification": ("qwen2", "value"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm"),
}


class MappingError(ValueError):
    """A model or layout the megatron mapping cannot represent."""


VLLM_VOCAB_MULTIPLE = 64
"""vLLM pads a vocabulary to a multiple of 64 before splitting it evenly over TP ranks."""


@dataclass(frozen=True)
class ModelDims:
    """The shapes that decide the mapping, read from a HF config."""

    family: Literal["llama", "qwen2", "qwen3_moe"]
    head: HeadKind
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    score_bias: bool = False
    fused_norms: bool = False
    """Transformer Engine spec: the pre-attention / pre-MLP norms live inside
    ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each query and key head (``q_norm`` / ``k_norm``)."""
    num_experts: int = 0
    """Routed experts per layer (0: a dense model); every layer is sparse."""
    moe_ffn_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    """Qwen3-MoE's router: softmax over all experts, top-k, renormalised when True."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, hf_config: Any, head: HeadKind, *, fused_norms: bool = False) -> ModelDims:
        """Dimensions of a Llama / Qwen2 config; unsupported variants are a clear error."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in ("llama", "qwen2", "qwen3_moe"):
            raise MappingError(
                "hf-megatron maps the llama, qwen2 and qwen3_moe families; "
                f"got model_type={model_type!r}"
            )
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            moe = _qwen3_moe_dims(hf_config, head)
        if model_type == "llama" and (
            getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)
        ):
            raise MappingError("llama with attention_bias / mlp_bias is not supported")
        if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
            raise MappingError("qwen2 with use_sliding_window=True is not supported")
        heads = hf_config.num_attention_heads
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            family=model_type,
            head=head,
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            ffn_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False))
            and head == "lm",
            qkv_bias=model_type == "qwen2",
            score_bias=head == "value" and getattr(hf_config, "token_classification_bias", True),
            fused_norms=fused_norms,
            **moe,
        )

    def padded_vocab(self, tp: int, divisible_by: int | None = None) -> int:
        """megatron's padded vocabulary: a multiple of ``divisible_by * tp``.

        ``None`` picks ``64 / tp`` when ``tp`` divides 64, which pads to a multiple of 64 --
        the padding vLLM's vocabulary-parallel layers use -- so every TP rank's rows are the
        same on both sides and generation TP slices load without regathering; otherwise 128.
        """
        if divisible_by is None:
            divisible_by = VLLM_VOCAB_MULTIPLE // tp if VLLM_VOCAB_MULTIPLE % tp == 0 else 128
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical tensor of the HF model and its full shape, in HF order."""
        h, hd = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.num_heads * hd, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.num_kv_heads * hd, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.num_kv_heads * hd, h)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.num_heads * hd,)
                shapes[p + "self_attn.k_proj.bias"] = (self.num_kv_heads * hd,)
                shapes[p + "self_attn.v_proj.bias"] = (self.num_kv_heads * hd,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.num_heads * hd)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.is_moe:
                f = self.moe_ffn_size
                shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (f, h)
                    shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (f, h)
                    shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, f)
                continue
            shapes[p + "mlp.gate_proj.weight"] = (self.ffn_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.ffn_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.ffn_size)
        shapes["model.norm.weight"] = (h,)
        if self.head == "lm":
            if not self.tie_word_embeddings:
                shapes["lm_head.weight"] = (self.vocab_size, h)
        else:
            shapes["score.weight"] = (1, h)
            if self.score_bias:
                shapes["score.bias"] = (1,)
        return shapes


def _qwen3_moe_dims(hf_config: Any, head: HeadKind) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE config; layouts megatron's model here
    does not build (dense layers among sparse ones, shared experts) are refused by name."""
    if head != "lm":
        raise MappingError(f"qwen3_moe is mapped for head='lm' only, got head={head!r}")
    if (
        getattr(hf_config, "mlp_only_layers", None)
        or getattr(hf_config, "decoder_sparse_step", 1) != 1
    ):
        raise MappingError(
            "qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not "
            "mapped: hf-megatron builds every layer sparse"
        )
    if getattr(hf_config, "attention_bias", False):
        raise MappingError("qwen3_moe with attention_bias is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise MappingError("qwen3_moe with use_sliding_window=True is not supported")
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise MappingError("qwen3_moe with shared experts is not supported")
    return {
        "qk_norm": True,
        "num_experts": int(hf_config.num_experts),
        "moe_ffn_size": int(hf_config.moe_intermediate_size),
        "moe_topk": int(hf_config.num_experts_per_tok),
        "norm_topk_prob": bool(getattr(hf_config, "norm_topk_prob", True)),
    }


@dataclass(frozen=True)
class RankPosition:
    """One megatron rank's place: its TP slice, pipeline stage and expert-parallel rank."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "ep"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if size < 1 or not 0 <= rank < size:
                raise MappingError(f"{axis}_rank={rank} is outside {axis}_size={size}")

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass(frozen=True)
class Part:
    """One canonical source range of a native tensor: ``hf_name[start:stop]`` along ``dim``
    (the whole tensor when ``dim`` is None)."""

    hf_name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class NativeParam:
    """One megatron parameter of one rank and how it is built from canonical parts."""

    name: str
    shape: tuple[int, ...]
    kind: Literal["slice", "replicated", "vocab", "qkv", "fc1"]
    parts: tuple[Part, ...]
    exported: bool = True
    """False for the tied output-layer copy: loaded, never exported."""
    groups: int = 0
    """``qkv``: KV groups on this rank; ``vocab``: real (unpadded) rows on this rank."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    # ----------------------------------------------------------- canonical -> native
    def build(self, fetch: Fetch, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The native tensor from canonical data (``fetch`` reads only the needed ranges)."""
        got = [fetch(p.hf_name, p.dim, p.start, p.stop) for p in self.parts]
        if self.kind in ("slice", "replicated"):
            out = got[0]
        elif self.kind == "vocab":
            out = got[0].new_zeros(self.shape)
            out[: got[0].shape[0]] = got[0]
        elif self.kind == "fc1":
            out = torch.cat(got, dim=0)
        else:  # qkv: interleave q, k, v per KV group
            q, k, v = got
            g = self.groups
            tail = q.shape[1:]
            out = torch.cat(
                [q.reshape(g, -1, *tail), k.reshape(g, -1, *tail), v.reshape(g, -1, *tail)], dim=1
            ).reshape(-1, *tail)
        if tuple(out.shape) != self.shape:
            raise MappingError(f"{self.name}: built shape {tuple(out.shape)} != {self.shape}")
        return out.to(dtype) if dtype is not None else out

    # ----------------------------------------------------------- native -> canonical
    def split(
        self,
        tensor: torch.Tensor,
        full_shapes: Mapping[str, tuple[int, ...]],
        include_tied: bool = False,
    ) -> list[CanonicalSlice]:
        """The canonical pieces held in ``tensor`` (this parameter's native value).

        The tied output-layer copy yields nothing unless ``include_tied`` (a generation
        pipeline stage without the embedding may need it).
        """
        if not (self.exported or include_tied):
            return []
        if tuple(tensor.shape) != self.shape:
            raise MappingError(f"{self.name}: got shape {tuple(tensor.shape)}, want {self.shape}")
        if self.kind in ("slice", "replicated"):
            blocks = [tensor]
        elif self.kind == "vocab":
            blocks = [tensor[: self.groups]]
        elif self.kind == "fc1":
            blocks = list(tensor.chunk(2, dim=0))
        else:
            g = self.groups
            tail = tensor.shape[1:]
            grouped = tensor.reshape(g, -1, *tail)
            q_rows = (self.parts[0].stop - self.parts[0].start) // g
            kv_rows = (self.parts[1].stop - self.parts[1].start) // g
            blocks = [
                grouped[:, :q_rows].reshape(-1, *tail),
                grouped[:, q_rows : q_rows + kv_rows].reshape(-1, *tail),
                grouped[:, q_rows + kv_rows :].reshape(-1, *tail),
            ]
        return [
            CanonicalSlice(p.hf_name, block, p.dim, p.start, full_shapes[p.hf_name])
            for p, block in zip(self.parts, blocks, strict=True)
            if block.numel() or p.dim is None
        ]


def _split_range(total: int, tp: int, rank: int) -> tuple[int, int]:
    size = total // tp
    return rank * size, (rank + 1) * size


def local_experts(dims: ModelDims, pos: RankPosition) -> range:
    """The global expert ids the expert-parallel rank at ``pos`` holds (contiguous)."""
    per_rank = dims.num_experts // pos.ep_size
    return range(pos.ep_rank * per_rank, (pos.ep_rank + 1) * per_rank)


def is_expert_param(name: str) -> bool:
    """Whether a native parameter is one expert's (sharded over the ``ep`` axis)."""
    return ".mlp.experts.local_experts." in name


def rank_params(
    dims: ModelDims, pos: RankPosition, padded_vocab: int, *, experts: bool = True
) -> list[NativeParam]:
    """Every native parameter of the rank at ``pos``, in a fixed order shared by all ranks.

    ``padded_vocab`` is the model's padded vocabulary (:meth:`ModelDims.padded_vocab`); it
    must be a multiple of the TP size.  ``experts=False`` leaves the rank's expert tensors
    out (what is identical on every expert-parallel rank: the reshard's training unit).
    """
    t, r = pos.tp_size, pos.tp_rank
    if padded_vocab % t or padded_vocab < dims.vocab_size:
        raise MappingError(
            f"padded vocabulary {padded_vocab} must be >= {dims.vocab_size} and divisible by tp={t}"
        )
    if dims.num_heads % t or dims.num_kv_heads % t:
        raise MappingError(
            f"tp={t} must divide num_heads={dims.num_heads} and num_kv_heads={dims.num_kv_heads}"
        )
    if dims.ffn_size % t:
        raise MappingError(f"tp={t} must divide intermediate_size={dims.ffn_size}")
    if dims.num_layers % pos.pp_size:
        raise MappingError(f"pp={pos.pp_size} must divide num_layers={dims.num_layers}")
    if dims.is_moe:
        if dims.num_experts % pos.ep_size:
            raise MappingError(
                f"ep={pos.ep_size} must divide the number of experts ({dims.num_experts})"
            )
        if dims.moe_ffn_size % t:
            raise MappingError(f"tp={t} must divide moe_intermediate_size={dims.moe_ffn_size}")
    elif pos.ep_size > 1:
        raise MappingError(f"ep={pos.ep_size} needs a mixture-of-experts model")
    h, hd = dims.hidden_size, dims.head_dim
    vp = padded_vocab
    v_lo, v_hi = _split_range(vp, t, r)
    real_lo, real_hi = min(v_lo, dims.vocab_size), min(v_hi, dims.vocab_size)
    real_rows = real_hi - real_lo
    vocab_part = (real_lo, real_hi)
    per_stage = dims.num_layers // pos.pp_size
    offset = pos.pp_rank * per_stage
    groups = dims.num_kv_heads // t
    q_lo, q_hi = _split_range(dims.num_heads * hd, t, r)
    kv_lo, kv_hi = _split_range(dims.num_kv_heads * hd, t, r)
    f_lo, f_hi = _split_range(dims.ffn_size, t, r)
    qkv_rows = (q_hi - q_lo) + 2 * (kv_hi - kv_lo)

    def vocab(name: str, hf_name: str, exported: bool = True) -> NativeParam:
        part = Part(hf_name, 0, *vocab_part)
        return NativeParam(name, (vp // t, h), "vocab", (part,), exported, groups=real_rows)

    def norm(name: str, hf_name: str) -> NativeParam:
        return NativeParam(name, (h,), "replicated", (Part(hf_name),))

    def columns(name: str, hf_name: str, lo: int, hi: int) -> NativeParam:
        """A row-parallel weight (linear_proj, linear_fc2): the rank's input columns."""
        return NativeParam(name, (h, hi - lo), "slice", (Part(hf_name, 1, lo, hi),))

    def gated_mlp(native: str, hf: str, lo: int, hi: int) -> list[NativeParam]:
        """A SwiGLU MLP's fc1 (the rank's rows of gate and up, stacked) and fc2 (its columns
        of down): a dense layer's, or one expert's."""
        fc1 = NativeParam(
            native + "linear_fc1.weight",
            (2 * (hi - lo), h),
            "fc1",
            (Part(hf + "gate_proj.weight", 0, lo, hi), Part(hf + "up_proj.weight", 0, lo, hi)),
        )
        return [fc1, columns(native + "linear_fc2.weight", hf + "down_proj.weight", lo, hi)]

    out: list[NativeParam] = []
    if pos.first_stage:
        out.append(vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"))
    for j in range(per_stage):
        n, p = f"decoder.layers.{j}.", f"model.layers.{offset + j}."
        attn_norm = (
            n + "self_attention.linear_qkv.layer_norm_weight"
            if dims.fused_norms
            else n + "input_layernorm.weight"
        )
        mlp_norm = (
            n + "mlp.linear_fc1.layer_norm_weight"
            if dims.fused_norms
            else n + "pre_mlp_layernorm.weight"
        )
        out.append(norm(attn_norm, p + "input_layernorm.weight"))
        for suffix, tail in (("weight", (h,)), ("bias", ())):
            if suffix == "bias" and not dims.qkv_bias:
                continue
            parts = (
                Part(f"{p}self_attn.q_proj.{suffix}", 0, q_lo, q_hi),
                Part(f"{p}self_attn.k_proj.{suffix}", 0, kv_lo, kv_hi),
                Part(f"{p}self_attn.v_proj.{suffix}", 0, kv_lo, kv_hi),
            )
            out.append(
                NativeParam(
                    f"{n}self_attention.linear_qkv.{suffix}",
                    (qkv_rows, *tail),
                    "qkv",
                    parts,
                    groups=groups,
                )
            )
        if dims.qk_norm:
            for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                out.append(
                    NativeParam(
                        f"{n}self_attention.{ours}.weight",
                        (hd,),
                        "replicated",
                        (Part(f"{p}self_attn.{theirs}.weight"),),
                    )
                )
        out.append(
            columns(
                n + "self_attention.linear_proj.weight", p + "self_attn.o_proj.weight", q_lo, q_hi
            )
        )
        out.append(norm(mlp_norm, p + "post_attention_layernorm.weight"))
        if dims.is_moe:
            out.append(
                NativeParam(
                    n + "mlp.router.weight",
                    (dims.num_experts, h),
                    "replicated",
                    (Part(p + "mlp.gate.weight"),),
                )
            )
            if not experts:
                continue
            e_lo, e_hi = _split_range(dims.moe_ffn_size, t, r)
            for local, expert in enumerate(local_experts(dims, pos)):
                ln, hp = f"{n}mlp.experts.local_experts.{local}.", f"{p}mlp.experts.{expert}."
                out += gated_mlp(ln, hp, e_lo, e_hi)
            continue
        out += gated_mlp(n + "mlp.", p + "mlp.", f_lo, f_hi)
    if pos.last_stage:
        out.append(norm("decoder.final_layernorm.weight", "model.norm.weight"))
        if dims.head == "lm":
            if not dims.tie_word_embeddings:
                out.append(vocab("output_layer.weight", "lm_head.weight"))
            elif pos.pp_size > 1:  # the tied copy on the last stage
                out.append(vocab("output_layer.weight", "model.embed_tokens.weight", False))
        else:
            out.append(
                NativeParam("output_layer.weight", (1, h), "replicated", (Part("score.weight"),))
            )
            if dims.score_bias:
                out.append(
                    NativeParam("output_layer.bias", (1,), "replicated", (Part("score.bias"),))
                )
    return out


def unit_numel(dims: ModelDims, pos: RankPosition, padded_vocab: int) -> int:
    """Elements of one training unit (the rank's whole parameter set)."""
    return sum(p.numel for p in rank_params(dims, pos, padded_vocab))


# --------------------------------------------------------------------- the mapping object
@dataclass
class MegatronWeightMapping(WeightMapping):
    """Canonical HF tensors <-> the native parameters of one megatron rank.

    ``from_canonical`` takes full canonical tensors (any order, any subset; a native tensor is
    produced once all its sources were seen).  ``to_canonical`` yields this rank's *pieces*
    of canonical tensors; with ``tp_size == 1`` they are whole tensors, otherwise use
    :meth:`canonical_pieces` for where each piece sits (or :func:`assemble` several ranks').
    """

    dims: ModelDims
    pos: RankPosition = field(default_factory=RankPosition)
    padded_vocab: int | None = None
    """Default: ``dims.padded_vocab(tp, 128)``, megatron's default padding."""

    def __post_init__(self) -> None:
        if self.padded_vocab is None:
            self.padded_vocab = self.dims.padded_vocab(self.pos.tp_size, 128)
        self.params = rank_params(self.dims, self.pos, self.padded_vocab)
        self.by_name = {p.name: p for p in self.params}
        self.full_shapes = self.dims.canonical_shapes()

    def native_shapes(self) -> dict[str, tuple[int, ...]]:
        return {p.name: p.shape for p in self.params}

    def canonical_pieces(self, native: Mapping[str, torch.Tensor]) -> Iterator[CanonicalSlice]:
        for name, tensor in native.items():
            param = self.by_name.get(name)
            if param is None:
                raise MappingError(f"{name!r} is not a parameter of megatron rank {self.pos}")
            yield from param.split(tensor, self.full_shapes)

    def to_canonical(self, native: Mapping[str, torch.Tensor]) -> Iterator[NamedTensor]:
        for piece in self.canonical_pieces(native):
            yield piece.name, piece.tensor

    def from_canonical(self, canonical: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        pending: dict[str, torch.Tensor] = {}
        waiting = {p.name: {part.hf_name for part in p.parts} for p in self.params}
        for name, tensor in canonical:
            if name not in self.full_shapes:
                raise MappingError(f"{name!r} is not a canonical tensor of this model")
            pending[name] = tensor
            ready = [n for n, needs in waiting.items() if needs <= pending.keys()]
            for native_name in ready:
                del waiting[native_name]
                yield native_name, self.by_name[native_name].build(_fetch_from(pending))

    def load(self, fetch: Fetch, dtype: torch.dtype | None = None) -> Iterator[NamedTensor]:
        """This rank's native tensors, reading canonical data through ``fetch``."""
        for param in self.params:
            yield param.name, param.build(fetch, dtype)


def _fetch_from(tensors: Mapping[str, torch.Tensor]) -> Fetch:
    def fetch(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        full = tensors[name]
        return full if dim is None else full.narrow(dim, start, stop - start)

    return fetch


def fetch_from(tensors: Mapping[str, torch.Tensor]) -> Fetch:
    """A :data:`Fetch` over full canonical tensors held in memory."""
    return _fetch_from(tensors)


# ------------------------------------------------------------------ generation TP slices
def tp_slice_range(
    dims: ModelDims, hf_name: str, tp_rank: int, tp_size: int, padded_vocab: int
) -> tuple[int | None, int, int]:
    """Where generation TP rank ``tp_rank`` of ``tp_size`` sits in a canonical tensor.

    Returns ``(dim, start, stop)``; ``dim`` None means replicated (the whole tensor).  The
    split is megatron's (and vLLM's): column-parallel q/k/v/gate/up and vocabulary rows along
    dim 0, row-parallel o/down along dim 1.  Vocabulary rows follow ``padded_vocab`` (the
    training layout's, so slices line up with the training shards) and are clipped to the
    real vocabulary.
    """
    shape = dims.canonical_shapes()[hf_name]
    if tp_size == 1:
        return (None, 0, 0)
    leaf = hf_name.rsplit(".", 2)
    module = leaf[-2] if len(leaf) >= 2 else ""
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        lo, hi = _split_range(padded_vocab, tp_size, tp_rank)
        lo, hi = min(lo, dims.vocab_size), min(hi, dims.vocab_size)
        return (0, lo, hi)
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return (0, *_split_range(shape[0], tp_size, tp_rank))
    if module in ("o_proj", "down_proj") and len(shape) == 2:  # a row-parallel bias is whole
        return (1, *_split_range(shape[1], tp_size, tp_rank))
    return (None, 0, 0)
