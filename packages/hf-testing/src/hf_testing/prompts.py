"""Prompts the rollout-engine tests generate from: varied, left-padded, deterministic."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_core.batch import Batch


def encode(path: Path, texts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded token ids and mask for ``texts`` (the format rollout engines take)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return dict(tokenizer(texts, return_tensors="pt", padding=True))


def prompt_texts(count: int) -> list[str]:
    """Prompts of varied length and content (so left padding and outputs vary)."""
    kinds = [
        lambda i: f"reverse {i * 7919 % 100000}:",
        lambda i: f"{i * 37 % 1000}+{i * 53 % 100}=",
        lambda i: "".join("abcdefghij"[(i * k) % 10] for k in range(1, 2 + i % 6)),
        lambda i: f"Hello, World {i}!",
    ]
    return [kinds[i % len(kinds)](i) for i in range(count)]


def prompt_batch(path: Path, count: int) -> Batch:
    """``count`` varied prompts for the model folder ``path``, as a rollout engine takes them."""
    enc = encode(path, prompt_texts(count))
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
