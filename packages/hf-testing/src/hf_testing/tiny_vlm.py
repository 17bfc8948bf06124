"""A tiny random Qwen2-VL model, its tokenizer and image processor, built locally.

The text model is the tiny Qwen2 of :mod:`hf_testing.tiny` (its tokenizer plus the four
vision tokens) and the vision tower one small block, so a whole model is about 0.2M
parameters and runs the real ``Qwen2VLForConditionalGeneration`` code: the patch embedding,
the 2x2 patch merger, the 3-D multimodal rotary positions.  The image processor is
transformers' PIL ``Qwen2VLImageProcessorPil`` with 14-pixel patches, so a 28x28-pixel cell
of an image is one image token after the merge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hf_testing.tiny import BOS, CHAT_TEMPLATE, EOS, PAD, build_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH = 14
MERGE = 2
CELL = PATCH * MERGE
"""Pixels of one side of the square one image token covers."""


def build_tiny_vlm(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vocab_size: int = 128,
    vision_depth: int = 1,
    vision_dim: int = 32,
    max_image_tokens: int = 64,
    initializer_range: float = 0.2,
    seed: int = 0,
    chat_template: bool = False,
) -> Path:
    """Write a tiny random Qwen2-VL (float32), tokenizer and image processor into ``path``.

    Images are resized to at most ``max_image_tokens`` image tokens (the processor's
    ``max_pixels``); the same arguments always give the same weights.
    """
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(
        zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True)
    )
    # head_dim 32 by default: vLLM's CPU attention needs at least that (it derives head_dim
    # from hidden / heads); the rotary sections (temporal, height, width) cover head_dim / 2
    # in Qwen2-VL's proportions (16, 24, 24 of 64)
    half = hidden_size // num_heads // 2
    temporal = half // 4
    height = (half - temporal) // 2
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 512,
        "initializer_range": initializer_range,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [temporal, height, half - temporal - height],
        },
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD),
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS),
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }
    vision = {
        "depth": vision_depth,
        "embed_dim": vision_dim,
        "hidden_size": hidden_size,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "initializer_range": initializer_range,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(
        min_pixels=CELL * CELL,
        max_pixels=max_image_tokens * CELL * CELL,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    processor.save_pretrained(path)
    reloaded = AutoTokenizer.from_pretrained(path)
    if reloaded.convert_tokens_to_ids(list(VISION_TOKENS)) != list(ids.values()):
        raise RuntimeError(f"{path}: vision token ids changed in a save/load round trip")
    return path


def vision_token_ids(folder: str | Path) -> dict[str, Any]:
    """The saved model's vision token ids, by token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return dict(
        zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True)
    )
