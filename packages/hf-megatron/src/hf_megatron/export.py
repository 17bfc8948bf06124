"""Write canonical tensors as a HuggingFace folder that ``from_pretrained`` loads."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hf_core.engines import NamedTensor, iter_buckets, tensor_nbytes


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
    """Every rank consumes ``stream`` (it runs collectives); rank 0 writes.  The folder
    appears atomically (written beside ``path``, then renamed into place)."""
    from safetensors.torch import save_file

    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = path.parent / f".{path.name}.tmp-export"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    files: list[tuple[Path, list[str]]] = []
    total = 0
    for i, bucket in enumerate(iter_buckets(stream, shard_bytes)):
        if rank != 0:
            continue
        part = tmp / f"part-{i:05d}.safetensors"
        save_file({n: t.detach().cpu().contiguous() for n, t in bucket}, part, {"format": "pt"})
        files.append((part, [n for n, _ in bucket]))
        total += sum(tensor_nbytes(t) for _, t in bucket)
    if rank == 0:
        if len(files) == 1:
            files[0][0].rename(tmp / "model.safetensors")
        else:
            weight_map: dict[str, str] = {}
            for i, (part, names) in enumerate(files, start=1):
                final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
                part.rename(tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
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
