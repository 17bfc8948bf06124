"""HuggingFace model folders: checking one, listing its weight files, its stop and pad tokens,
and writing one that ``from_pretrained`` loads.

Every backend reads and writes the same folder format (``config.json``, optional
``generation_config.json``, ``model.safetensors`` or shards with an index), so these live here
once: engines of different backends built from one folder agree on stop and pad ids, and an
export from any training engine looks the same.

Checking a folder reads JSON and file headers only: the pre-start checks run it before torch
is imported, so torch (and the tensor helpers) are imported where a folder is written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_core.errors import ModelFolderError

if TYPE_CHECKING:
    from hf_core.engines.weights import NamedTensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files one of which a tokenizer saved with ``save_pretrained`` has."""
_JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _prefix(key: str | None) -> str:
    """``"model.path: "`` -- so a message names the recipe key before the folder."""
    return f"{key}: " if key else ""


def check_model_folder(path: str | Path, *, key: str | None = None, weights: bool = False) -> Path:
    """The folder as a Path, or a :class:`ModelFolderError` (a ``FileNotFoundError``) saying
    what is missing.

    ``config.json`` must hold a JSON object; ``weights=True`` also checks the safetensors
    files (:func:`check_weight_files`).  ``key`` (the recipe key the path came from) leads the
    message, so a run's preflight says which setting to fix.
    """
    folder = Path(path).expanduser()
    where = _prefix(key)
    if not folder.exists():
        raise ModelFolderError(f"{where}model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelFolderError(
            f"{where}model path {folder} is not a folder (expected a HF model dir)"
        )
    read_model_config(folder, key=key)
    if weights:
        check_weight_files(folder, key=key)
    return folder


def _read_json(path: Path, where: str, what: str) -> Any:
    """``path``'s JSON, or a :class:`ModelFolderError` naming the file, line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"{where}cannot read {path}: {exc}") from None
    if not text.strip():
        raise ModelFolderError(f"{where}{path} is empty; it should hold {what}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFolderError(
            f"{where}{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); it should hold {what}"
        ) from None


def read_model_config(folder: Path, *, key: str | None = None) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict; a :class:`ModelFolderError` naming the file
    when it is absent, empty or not a JSON object (checked before any engine parses it)."""
    where = _prefix(key)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ModelFolderError(
            f"{where}model folder {folder} has no {CONFIG_FILE} (is it a HuggingFace model folder?)"
        )
    what = "the model's HuggingFace config (written by model.save_pretrained)"
    config = _read_json(path, where, what)
    if not isinstance(config, dict):
        raise ModelFolderError(
            f"{where}{path} holds a JSON {type(config).__name__}, not an object; it should hold "
            f"{what}"
        )
    return config


def check_weight_files(folder: Path, *, key: str | None = None) -> None:
    """Raise :class:`ModelFolderError` unless ``folder`` has readable safetensors weights.

    Reads only the index or the file header, not the tensors: cheap enough to run before any
    process starts, and it catches what would otherwise fail on every rank after Ray started.
    """
    where = _prefix(key)
    index = folder / INDEX_FILE
    if index.is_file():
        _check_index(index, where)
        return
    single = folder / SINGLE_FILE
    if single.is_file():
        _check_safetensors_header(single, where)
        return
    found = sorted(p.name for p in folder.glob("*.bin")) + sorted(
        p.name for p in folder.glob("*.pt")
    )
    other = f" (found {', '.join(found[:3])}: not safetensors)" if found else ""
    raise ModelFolderError(
        f"{where}model folder {folder} has no {SINGLE_FILE} or {INDEX_FILE}{other}; save the "
        f"model with save_pretrained(..., safe_serialization=True)"
    )


def _check_index(index: Path, where: str) -> None:
    data = _read_json(index, where, "a safetensors index with a 'weight_map'")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFolderError(f"{where}{index} has no 'weight_map' naming the weight shards")
    missing = sorted({str(f) for f in weight_map.values()} - _present(index.parent))
    if missing:
        raise ModelFolderError(
            f"{where}{index} names shard(s) missing from {index.parent}: {', '.join(missing[:3])}"
            + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        )


def _present(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def _check_safetensors_header(path: Path, where: str) -> None:
    """A safetensors file starts with an 8-byte little-endian length and that much JSON."""
    size = path.stat().st_size
    bad = f"{where}{path} is not a safetensors file (empty, truncated or damaged)"
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ModelFolderError(bad)
        length = int.from_bytes(head, "little")
        if length <= 0 or 8 + length > size:
            raise ModelFolderError(bad)
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFolderError(bad) from None
    if not isinstance(header, dict):
        raise ModelFolderError(bad)


def check_tokenizer(path: str | Path, *, key: str | None = None) -> Any:
    """Load the tokenizer saved in ``path``; a :class:`ModelFolderError` naming the folder and
    the file at fault otherwise.

    The files are checked first (present, JSON where they should be), so the common mistakes
    get a message about the file, not transformers' guesses about converters it might need.
    The loaded tokenizer must have a pad or EOS token: prompts are padded with one.
    """
    folder = Path(path).expanduser()
    where = _prefix(key)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise ModelFolderError(f"{where}tokenizer folder {folder} {what}")
    present = _present(folder)
    if not present & set(TOKENIZER_FILES):
        raise ModelFolderError(
            f"{where}tokenizer folder {folder} has no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}); save one there with tokenizer.save_pretrained(...) "
            "or point model.tokenizer_path at a folder that has one"
        )
    for name in _JSON_TOKENIZER_FILES:
        if name in present:
            _read_json(folder / name, where, "the tokenizer (written by save_pretrained)")
    if "tokenizer.json" in present:
        _check_tokenizer_json(folder / "tokenizer.json", where)
    tokenizer = _load_tokenizer(folder, where)
    if getattr(tokenizer, "pad_token_id", None) is None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ModelFolderError(
                f"{where}the tokenizer in {folder} has neither a pad token nor an EOS token; "
                "prompts are padded with one: set pad_token in its tokenizer_config.json"
            )
    return tokenizer


def _check_tokenizer_json(path: Path, where: str) -> None:
    """The ``tokenizers`` library's own reading of ``tokenizer.json``: its error names the
    missing or wrong field and the line, which transformers' loader does not pass on."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # transformers falls back to the slow files
        return
    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ModelFolderError(
            f"{where}{path} is not a tokenizer file the tokenizers library can read "
            f"({_first_line(str(exc))}); re-save it with tokenizer.save_pretrained(...)"
        ) from None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _load_tokenizer(folder: Path, where: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken folder
        reason = _tokenizer_failure(exc)
        raise ModelFolderError(
            f"{where}cannot load the tokenizer in {folder}: {reason}; re-save it with "
            "tokenizer.save_pretrained(...)"
        ) from None


def _tokenizer_failure(exc: Exception) -> str:
    """The first line of transformers' error, unless it is its generic advice about slow
    tokenizer converters (which is not what is wrong with a local folder)."""
    first = _first_line(str(exc))
    generic = ("sentencepiece", "tiktoken", "slow tokenizer", "instantiate the backend")
    if not first or any(word in first.lower() for word in generic):
        return (
            "its files (tokenizer.json / tokenizer_config.json) do not describe a tokenizer "
            "this transformers version can build"
        )
    return f"{type(exc).__name__}: {first}"


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

    from hf_core.engines.weights import tensor_nbytes

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
    import torch.distributed as dist

    from hf_core.engines.weights import iter_buckets

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
