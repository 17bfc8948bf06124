"""What the conformance checks compare engines against: plain transformers and the model folder.

Nothing here imports a backend, so a rollout backend's tests need no training backend: the
canonical weights to sync come straight from the folder's safetensors files, the expected
tokens from ``model.generate`` and the expected log-probs from one padded HF forward.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.engines import NamedTensor, iter_buckets

# ------------------------------------------------------------------ canonical weights


def folder_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The canonical tensors of a HF folder, exactly as saved (one file or an index).

    Canonical = transformers' state-dict names as ``save_pretrained`` writes them: a tied
    ``lm_head.weight`` is not in the files, so it is not here either.
    """
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors(.index.json)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def perturbed(tensors: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The same tensors plus seeded noise (per tensor name, so every rank agrees)."""
    out = {}
    for name, tensor in tensors.items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = tensor + scale * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
    return out


def canonical_buckets(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int
) -> Iterator[list[NamedTensor]]:
    """``tensors`` in buckets, the way a training engine's ``export_weights`` streams them."""
    return iter_buckets(tensors.items(), bucket_bytes)


def bucket_bytes_of(bucket: list[NamedTensor]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


# -------------------------------------------------------------------------- HF models


def hf_causal_lm(path: str | Path, state: Mapping[str, torch.Tensor] | None = None) -> Any:
    """transformers' model of the folder (float32, eval), optionally with other weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None and not set(state) <= set(model.state_dict()):
        return _loaded_as_checkpoint(path, state)
    if state is not None:
        missing, unexpected = model.load_state_dict(dict(state), strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise KeyError(f"state does not fit the model: missing {missing}, extra {unexpected}")
    return model


def _loaded_as_checkpoint(path: str | Path, state: Mapping[str, torch.Tensor]) -> Any:
    """transformers' model of the folder with ``state`` in the checkpoint's names (e.g. an
    MoE model's per-expert tensors, which transformers 5 fuses as it loads): written beside
    the folder's config and loaded the way ``from_pretrained`` converts a checkpoint."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("config.json", "generation_config.json"):
            if (Path(path) / name).exists():
                shutil.copy(Path(path) / name, Path(tmp) / name)
        tensors = {n: t.detach().cpu().contiguous() for n, t in state.items()}
        save_file(tensors, str(Path(tmp) / "model.safetensors"), {"format": "pt"})
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, output_loading_info=True
        )
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(info["missing_keys"]) - tied
    if missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise KeyError(f"state does not fit the model: {info}")
    return model.eval()


def hf_log_probs_and_entropy(
    model: torch.nn.Module, batch: Batch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``responses`` under ``softmax(logits / T)`` and the entropy.

    ``T == 0`` means greedy decoding, whose log-probs are of the raw logits.
    """
    scaled = _response_logits(model, batch, temperature)
    log_probs = torch.log_softmax(scaled, -1).gather(-1, batch["responses"][..., None])[..., 0]
    return log_probs, torch.distributions.Categorical(logits=scaled).entropy()


def _response_logits(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """``[B, R, V]`` float32 logits over ``temperature`` at the positions predicting each
    response token."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    length = batch["responses"].shape[1]
    return logits[:, -length - 1 : -1].float() / (temperature or 1.0)


def hf_top_k(
    model: torch.nn.Module, batch: Batch, temperature: float, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response position's ``k`` likeliest ids and their log-probs, ``[B, R, k]``."""
    top = torch.log_softmax(_response_logits(model, batch, temperature), -1).topk(k, dim=-1)
    return top.values, top.indices


def hf_log_probs_at(
    model: torch.nn.Module, batch: Batch, ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The log-probs of ``ids`` ``[B, R, k]`` at each response position."""
    return torch.log_softmax(_response_logits(model, batch, temperature), -1).gather(-1, ids)


def hf_greedy(model: Any, prompts: Batch, max_new_tokens: int) -> list[list[int]]:
    """transformers' own ``generate``: each row's tokens up to and including the first EOS."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.config.pad_token_id,
            eos_token_id=eos,
        )
    rows = []
    for row in out[:, prompts["input_ids"].shape[1] :].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
        rows.append(row if stop is None else row[: stop + 1])
    return rows


def responses_of(batch: Batch) -> list[list[int]]:
    """Each row's response tokens under its ``response_mask``."""
    lengths = batch["response_mask"].sum(-1).tolist()
    return [row[:n] for row, n in zip(batch["responses"].tolist(), lengths, strict=True)]


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())
