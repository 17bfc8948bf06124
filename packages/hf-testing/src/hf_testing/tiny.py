"""Tiny random-weight models and a locally trained tokenizer, for tests and the demo.

No model hub is reachable, so every model the project uses is built here: a Llama or Qwen2
with seeded random weights (``initializer_range=0.2`` by default, large enough that greedy
outputs differ between prompts, so parity tests can fail) and a byte-level BPE tokenizer
trained with the ``tokenizers`` library on a small synthetic corpus of digits, arithmetic,
digit reversal and letters.

The tokenizer uses exactly the pipeline transformers' ``Qwen2Tokenizer`` rebuilds from
``vocab`` + ``merges`` (NFC, Qwen's split regex, byte level), because ``AutoTokenizer`` loads
every ``model_type=qwen2`` folder as ``Qwen2Tokenizer``: any other pipeline would give
different ids after a save/load round trip.  Its special tokens are in the vocabulary, so no
extra token is appended and ``len(tokenizer) == config.vocab_size``.  Both are checked when
the folder is written.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypedDict, Unpack

import torch

Family = Literal["llama", "qwen2", "qwen3_moe"]
Head = Literal["lm", "value", "score"]

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|endoftext|>")
PAD, BOS, EOS = SPECIAL_TOKENS
# transformers' Qwen2 pre-tokenizer regex (kept verbatim so both pipelines agree).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: "
    "{% for t in tools %}{{ t.function.name }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{% if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments }}}</tool_call>{% endfor %}<|endoftext|>\n'
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-style chat template with Hermes tool calls for the tiny tokenizers: an assistant
turn ends with the EOS token (what the model samples to stop), tool results come back as a
``<tool_response>`` user turn.  What it inserts after a sampled turn for a tool message (the
newline after EOS, the tool turn, the next assistant opening) is exactly the agent loop's
default tool message, ``hf_core.agents.config.QWEN_TOOL_RESPONSE``."""
_ROUND_TRIP_TEXT = "reverse 90210: 01209. 12+34=46? Hello, World! (x-y)*z/2; ok"


def _corpus(seed: int, lines: int = 1500) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 8)))
        words = " ".join(
            "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 6)))
            for _ in range(4)
        )
        out += [f"{a}+{b}={a + b}", f"reverse {digits}: {digits[::-1]}", words + "., :;?!()-*/"]
    return out


def _tool_corpus(seed: int, lines: int = 300) -> list[str]:
    """Hermes/Qwen tool calls and tool messages, so their characters and tags get tokens."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 9999), rng.randint(0, 999)
        op = rng.choice("+-*")
        call = {"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}}
        out += [
            f"<tool_call>{json.dumps(call)}</tool_call>",
            f"\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
            "error: [] {} _ # ' = < > | ` \\ @ $ % & ^ ~",
        ]
    return out


def build_tokenizer(vocab_size: int = 128, seed: int = 0, *, tool_calls: bool = False) -> Any:
    """A byte-level BPE tokenizer trained on a synthetic corpus (deterministic for a seed);
    ``tool_calls`` adds tool-call text to the corpus (:func:`_tool_corpus`), which needs a
    larger ``vocab_size`` (e.g. 256) to leave room for digit and word merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    corpus = _corpus(seed) + (_tool_corpus(seed) if tool_calls else [])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=None
    )


TINY_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.0,
}
"""The tiny Qwen3-MoE's router: 4 experts, top-2 (Qwen3-30B-A3B: 128, top-8)."""


def tiny_config(
    family: Family,
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.2,
    max_position_embeddings: int = 512,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}.get(family)
    if cls is None:
        raise ValueError(f"family must be 'llama', 'qwen2' or 'qwen3_moe', got {family!r}")
    # a mixture of experts: every layer sparse, TINY_MOE experts of half the dense width
    moe = TINY_MOE if family == "qwen3_moe" else {}
    if moe:
        moe = {**moe, "moe_intermediate_size": intermediate_size or hidden_size}
    return cls(
        **moe,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        # None: hidden_size // num_heads.  Llama reads an explicit width in every engine
        # here (transformers, vLLM, the lean decoder); vLLM's Qwen2 ignores it.
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attention_dropout=0.0,
    )


class ModelShape(TypedDict, total=False):
    """The sizes :func:`build_tiny_model` passes on to :func:`tiny_config` (defaults there)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None
    intermediate_size: int | None
    tie_word_embeddings: bool
    initializer_range: float


def build_tiny_model(
    path: str | Path,
    family: Family = "qwen2",
    *,
    head: Head = "lm",
    vocab_size: int = 128,
    seed: int = 0,
    tool_calls: bool = False,
    chat_template: bool = False,
    **shape: Unpack[ModelShape],
) -> Path:
    """Write a tiny random model (float32) and its tokenizer into ``path``; returns it.

    ``head``: ``"lm"`` (causal LM), ``"value"`` (token classification, ``num_labels=1``) or
    ``"score"`` (sequence classification, ``num_labels=1``); ``shape``: the model's sizes
    (:class:`ModelShape`, defaults of :func:`tiny_config`).  The same arguments always give
    the same weights; ``seed`` changes the weights only, so all tiny models of one
    ``vocab_size`` share a tokenizer (an actor and its reward model must agree on ids).
    ``tool_calls``: a tokenizer that can write Hermes tool calls (:func:`build_tokenizer`).
    ``chat_template``: the tokenizer gets :data:`CHAT_TEMPLATE` (chat APIs need one).
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # One tokenizer for every model seed: actor, critic and reward models must share ids.
    tokenizer = build_tokenizer(vocab_size=vocab_size, tool_calls=tool_calls)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = tiny_config(
        family,
        len(tokenizer),
        pad_token_id=ids[PAD],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        **shape,
    )
    if head != "lm":
        config.num_labels = 1
        config.classifier_dropout = 0.0
    auto = {
        "lm": AutoModelForCausalLM,
        "value": AutoModelForTokenClassification,
        "score": AutoModelForSequenceClassification,
    }[head]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    # The round trip docs/platform.md describes: reload both the way users will.
    reloaded = AutoTokenizer.from_pretrained(path)
    saved = AutoConfig.from_pretrained(path)
    if len(reloaded) != saved.vocab_size:
        raise RuntimeError(
            f"{path}: tokenizer has {len(reloaded)} tokens after reload, model vocab is "
            f"{saved.vocab_size}"
        )
    before = tokenizer(_ROUND_TRIP_TEXT)["input_ids"]
    after = reloaded(_ROUND_TRIP_TEXT)["input_ids"]
    if before != after or reloaded.decode(after) != _ROUND_TRIP_TEXT:
        raise RuntimeError(f"{path}: token ids changed in a save/load round trip")
    return path


# Named specs (``build_tiny_model`` keyword arguments) the test suites share, so a "llama" is
# the same model in every package's tests.
QWEN2_TIED: dict[str, Any] = {"family": "qwen2", "tie_word_embeddings": True}
"""q/k/v biases, lm_head shared with the embedding."""
LLAMA: dict[str, Any] = {"family": "llama", "seed": 1}
"""No biases, an untied lm_head."""
STANDARD_MODELS: dict[str, dict[str, Any]] = {
    "qwen2_tied": QWEN2_TIED,
    "llama": LLAMA,
    "value": {"family": "llama", "head": "value", "seed": 2},
    "score": {"family": "qwen2", "head": "score", "seed": 3},
}
"""Both families, tied and untied, and the three head kinds: the plugin's ``models``."""


def build_tiny_models(root: str | Path, specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Path]:
    """One folder per spec under ``root`` (``root / name``); returns ``{name: folder}``."""
    root = Path(root)
    return {name: build_tiny_model(root / name, **spec) for name, spec in specs.items()}
