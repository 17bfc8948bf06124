"""Random-weight models with the published architectures of real small models.

Benches and memory tests need real shapes (a 151,936-token vocabulary, 24 layers, GQA) and
no model hub is reachable, so :data:`SHAPES` holds the public architecture hyperparameters
and :func:`build_shape_model` writes a seeded random-weight model folder from them with the
locally trained tokenizer of :mod:`hf_testing.tiny`.  Token ids (pad/bos/eos) come from that
tokenizer, not from the published configs.

The tokenizer knows a few hundred tokens; the model's vocabulary is far larger (the real
Qwen2.5 pads its vocabulary too).  Text never encodes to an id above the trained ones, but a
random model samples them all the time, and a plain tokenizer drops such ids from
``decode`` without a word and maps them to ``None`` in ``convert_ids_to_tokens``, which
breaks incremental detokenizers.  So the tokenizer is padded with non-special added tokens
``<|placeholder_ID|>`` up to the model's vocabulary: every id decodes to visible text, and
that text encodes back to the same ids.  The price is a slower ``AutoTokenizer`` load
(~4 s: transformers copies every added token).

:func:`cached_shape_model` keeps one folder per (shape, dtype, seed) under a directory; a
folder is built in a temporary directory and renamed into place, so a cache entry is
always complete.  ``python -m hf_testing.real_shapes SHAPE CACHE_DIR`` does the same and
prints the folder.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch

from hf_testing.tiny import BOS, EOS, PAD, SPECIAL_TOKENS, build_tokenizer

DType = Literal["float32", "bfloat16"]

_QWEN25_05B: dict[str, Any] = {
    "model_type": "qwen2",  # Qwen2 has q/k/v biases built in (no config flag)
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}
_QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",  # every layer a mixture: 128 experts, 8 routed per token
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "max_window_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen2.5-1.5b": {
        **_QWEN25_05B,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "max_position_embeddings": 131072,
    },
    "llama-3.2-1b": {
        "model_type": "llama",  # no attention or MLP biases
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
    # The CI shape: the real vocabulary (whose embedding is most of the memory) at 2 layers.
    "qwen2.5-0.5b-2layers": {**_QWEN25_05B, "num_hidden_layers": 2},
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # The MoE bench shape: Qwen3-30B-A3B's router (128 experts, top-8) and vocabulary at 4
    # layers of a quarter of the width, about 300M parameters (half of them the embeddings).
    "qwen3-30b-a3b-scaled": {
        **_QWEN3_30B_A3B,
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "moe_intermediate_size": 192,
        "intermediate_size": 1536,
        "max_window_layers": 4,
    },
}
"""Shape name -> ``AutoConfig.for_model`` keyword arguments (the published architectures)."""

# The tokenizer every shape gets: tiny.py's, with tool-call text so tool tasks can run too.
_TOKENIZER: dict[str, Any] = {"vocab_size": 256, "tool_calls": True}
# Bump when the folder format or the builder changes, so old cache entries are not reused.
_FORMAT = 1
_STALE_TMP_S = 3600.0
_CHECK_TEXT = "reverse 90210: 01209. 12+34=46? Hello, World! (x-y)*z/2; ok"


def shape_config(shape: str) -> Any:
    """The transformers config of ``shape`` (without token ids; the builder sets those)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    kwargs = copy.deepcopy(SHAPES[shape])  # transformers 5 edits the rope_scaling it is given
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def parameter_count(shape: str) -> int:
    """Parameters of ``shape``, a tied embedding counted once; built on the meta device, so
    it costs no memory and no time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    return sum(p.numel() for p in model.parameters())  # parameters() skips shared tensors


def shape_tokenizer(vocab_size: int) -> Any:
    """tiny.py's tokenizer padded with ``<|placeholder_ID|>`` tokens to ``vocab_size`` ids, so
    every id a random model samples decodes to text that encodes back to it."""
    from tokenizers import AddedToken

    tokenizer = build_tokenizer(**_TOKENIZER)
    first = len(tokenizer)
    if first > vocab_size:
        raise ValueError(f"tokenizer has {first} tokens, more than the vocabulary {vocab_size}")
    tokenizer.add_tokens(
        [
            AddedToken(f"<|placeholder_{i}|>", special=False, normalized=False)
            for i in range(first, vocab_size)
        ]
    )
    return tokenizer


def build_shape_model(
    shape: str, path: str | Path, *, dtype: DType = "float32", seed: int = 0
) -> Path:
    """Write a random-weight ``shape`` model (safetensors, ``dtype``) and its padded
    tokenizer into ``path``; returns it.  The same arguments give the same weights.

    The model is built directly in ``dtype`` (transformers initialises each weight once), so
    the peak memory is about one copy of the model: ~1 GB for the 0.5B shape in bfloat16.
    The tokenizer and config are reloaded the way users load them and checked to agree.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape)
    tokenizer = shape_tokenizer(config.vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config.pad_token_id, config.bos_token_id, config.eos_token_id = ids[PAD], ids[BOS], ids[EOS]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    del model
    tokenizer.save_pretrained(path)

    reloaded = AutoTokenizer.from_pretrained(path)
    saved = AutoConfig.from_pretrained(path)
    last = saved.vocab_size - 1
    text = f"{_CHECK_TEXT}<|placeholder_{last}|>"
    before = tokenizer(text)["input_ids"]
    checks = {
        "tokenizer size == model vocabulary": len(reloaded) == saved.vocab_size,
        "ids survive a save/load round trip": reloaded(text)["input_ids"] == before,
        "text survives encode/decode": reloaded.decode(before) == text,
        "the last id is the last placeholder": before[-1] == last,
        "pad/eos ids match the config": (reloaded.pad_token_id, reloaded.eos_token_id)
        == (saved.pad_token_id, saved.eos_token_id)
        == (ids[PAD], ids[EOS]),
    }
    if failed := [name for name, ok in checks.items() if not ok]:
        raise RuntimeError(f"{path}: check failed: {', '.join(failed)}")
    return path


def cache_key(shape: str, dtype: DType = "float32", seed: int = 0) -> str:
    """The cache folder name: shape, dtype, seed and a digest of everything the folder is
    built from, so editing a shape or the builder never reuses an old folder."""
    spec = json.dumps([SHAPES[shape], _TOKENIZER, _FORMAT], sort_keys=True)
    return f"{shape}-{dtype}-seed{seed}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"


def cached_shape_model(
    shape: str, cache_dir: str | Path, *, dtype: DType = "float32", seed: int = 0
) -> Path:
    """``cache_dir / cache_key(...)``, built by :func:`build_shape_model` if missing.

    The folder is built under a hidden temporary name and renamed into place when complete,
    so a killed build never leaves a folder that looks cached; temporary folders older than
    an hour (left by killed builds) are removed here.  Two processes building the same key
    at once both build; the second rename loses and its copy is dropped.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cache_dir = Path(cache_dir)
    key = cache_key(shape, dtype, seed)
    final = cache_dir / key
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    for old in cache_dir.glob(".tmp-*"):
        with contextlib.suppress(OSError):  # another process may be removing it too
            if time.time() - old.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(old)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".tmp-{key}-{socket.gethostname()}-{os.getpid()}-", dir=cache_dir)
    )
    try:
        build_shape_model(shape, tmp, dtype=dtype, seed=seed)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    """``python -m hf_testing.real_shapes SHAPE CACHE_DIR [--dtype D] [--seed N]``: build (or
    find) the cached folder and print its path, e.g. ``MODEL=$(python -m ...)`` in a bench."""
    parser = argparse.ArgumentParser(
        prog="python -m hf_testing.real_shapes", description=main.__doc__
    )
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("cache_dir", type=Path, help="cache root; the model is a folder in it")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(cached_shape_model(args.shape, args.cache_dir, dtype=args.dtype, seed=args.seed))


if __name__ == "__main__":
    main()
