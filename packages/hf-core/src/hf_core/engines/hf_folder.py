"""HuggingFace model folders: checking one, listing its weight files, its stop and pad tokens,
and writing one that ``from_pretrained`` loads.

Every backend reads and writes the same folder layout (``config.json``, optional
``generation_config.json``, ``model.safetensors`` or shards with an index), so these live here
once: engines of different backends built from one folder agree on stop and pad ids, and an
export from any training engine looks the same.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hf_core.engines.weights import NamedTensor, iter_buckets, tensor_nbytes
from hf_core.errors import ModelFolderError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def check_model_folder(path: str | Path) -> Path:
    """The folder as a Path, or a :class:`ModelFolderError` (a ``FileNotFoundError``) saying
    what is missing."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelFolderError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelFolderError(f"model path {folder} is not a folder (expected a HF model dir)")
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"model folder {folder} has no config.json (is it a HuggingFace model folder?)"
        )
    return folder


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (single-file or sharded with an index)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise ModelFolderError(
        f"model folder {folder} has no {SINGLE_FILE} or {INDEX_FILE} "
        f"(save the model with save_pretrained(..., safe_serialization=True))"
    )


def token_ids(value: Any) -> list[int]:
    """A config's token id entry (``None``, one id or a list of ids) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a rollout engine stops on and pads responses with."""

    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def special_tokens(folder: Path, config: Any = None) -> SpecialTokens:
    """EOS and pad ids for a model folder, the same for every rollout engine.

    ``generation_config.json`` first, then ``config.json`` (``config``: the model's config when
    the caller has it loaded already).  Without a pad id the first EOS id pads (else 0).
    """
    from transformers import AutoConfig, GenerationConfig

    if config is None:
        config = AutoConfig.from_pretrained(folder)
    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    eos = token_ids(gen.eos_token_id) or token_ids(getattr(config, "eos_token_id", None))
    pad = gen.pad_token_id
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    return SpecialTokens(tuple(eos), int(pad if pad is not None else (eos or [0])[0]))


def _write_shards(buckets: Iterable[list[NamedTensor]], folder: Path, write: bool) -> None:
    """Write each bucket as one safetensors file (plus an index when there are several)."""
    from safetensors.torch import save_file

    files: list[tuple[Path, list[str]]] = []
    total = 0
    for i, bucket in enumerate(buckets):
        if not write:
            continue  # other ranks only take part in the gathers
        path = folder / f"part-{i:05d}.safetensors"
        save_file(
            {name: t.detach().cpu().contiguous() for name, t in bucket}, path, {"format": "pt"}
        )
        files.append((path, [name for name, _ in bucket]))
        total += sum(tensor_nbytes(t) for _, t in bucket)
    if not write:
        return
    if len(files) == 1:
        files[0][0].rename(folder / SINGLE_FILE)
        return
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        path.rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def save_hf_folder(
    stream: Iterable[NamedTensor],
    path: str | Path,
    hf_config: Any,
    architecture: str,
    *,
    shard_bytes: int,
    tokenizer: Any = None,
    source_folder: Path | None = None,
) -> Path:
    """Write a folder that ``from_pretrained`` loads; every rank calls, rank 0 writes.

    Every rank consumes ``stream`` (a training engine's export runs collectives).  The folder
    appears atomically: it is written next to ``path`` and renamed into place, so a crash
    leaves either the previous folder or none, never a half-written one.  ``tokenizer`` (a
    folder or a tokenizer object) is saved alongside; ``source_folder``'s
    ``generation_config.json`` is copied.
    """
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = path.parent / f".{path.name}.tmp-export"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _write_shards(iter_buckets(stream, shard_bytes), tmp, write=rank == 0)
    if rank == 0:
        hf_config.architectures = [architecture]
        hf_config.save_pretrained(tmp)
        if source_folder is not None and (source_folder / "generation_config.json").is_file():
            shutil.copy2(source_folder / "generation_config.json", tmp)
        if tokenizer is not None:
            if isinstance(tokenizer, (str, Path)):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            tokenizer.save_pretrained(tmp)
        old = path.parent / f".{path.name}.old-export"
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return path
