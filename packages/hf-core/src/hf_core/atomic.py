"""Files that appear whole or not at all, and checkpoint files that are checked before use.

Datasets, metric logs and plots are all replaced this way, so a crash mid-write never leaves a
half-written file where a reader (or a resumed run) would find it.

Checkpoints add two guards, shared by the trainer and every backend (this module imports
only the standard library at import time, so any layer may use it):

* a **manifest** (JSON, written last) listing every file with its size and sha256, so a
  truncated, altered or foreign folder is refused before anything in it is read;
* :func:`load_tensor_file`, ``torch.load`` with ``weights_only=True``: a pickle that would
  build arbitrary objects (and so could run code) is refused, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hf_core.errors import CheckpointError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "hybridflow-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20  # hash in 1 MiB reads: memory stays flat for any file size


@contextmanager
def replaced_atomically(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write; when the block succeeds it replaces
    ``path`` (keeping the replaced file's mode, else 0644), when it fails it is removed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp makes 0600 files: keep the mode of the file replaced, else use 0644.
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------ manifests


def file_sha256(path: Path) -> str:
    """The file's sha256, read in chunks so a multi-GiB shard never sits in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(folder: Path, exclude: Iterable[str]) -> list[str]:
    skip = set(exclude)
    names = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(name for name in names if name not in skip)


def describe_files(folder: Path, exclude: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` for every file under ``folder``."""
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
        for name in _files_under(folder, exclude)
    }


def file_problems(
    folder: Path, files: dict[str, dict[str, Any]], exclude: Iterable[str] = ()
) -> list[str]:
    """What differs between ``folder`` and a :func:`describe_files` listing: missing,
    resized, altered and unlisted files, one line each naming the file (cheap size checks
    first, so a truncated file is not hashed)."""
    problems = []
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != want.get("size"):
            problems.append(f"{path} is {path.stat().st_size} bytes, expected {want.get('size')}")
        elif file_sha256(path) != want.get("sha256"):
            problems.append(f"{path} does not match its sha256 (altered or corrupted)")
    problems += [
        f"{folder / name} is not in the manifest"
        for name in _files_under(folder, exclude)
        if name not in files
    ]
    return problems


def write_manifest(folder: Path, kind: str, **info: Any) -> Path:
    """Write ``folder/manifest.json`` covering every file under ``folder``; call it last,
    once nothing else will be written there, so its presence means "complete"."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "kind": kind,
        **info,
        "files": describe_files(folder, exclude=[MANIFEST]),
    }
    target = folder / MANIFEST
    with replaced_atomically(target) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))
    return target


def read_manifest(folder: Path, kind: str) -> dict[str, Any]:
    """The verified manifest of ``folder``: raises :class:`CheckpointError` naming the file
    when it is missing, not ours, of another kind, or when any file differs from it."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: {folder} is incomplete or not a HybridFlow {kind} "
            "checkpoint (the manifest is written last, so a crashed save lacks it)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} is not a HybridFlow manifest (no file listing)")
    found = (manifest.get("format"), manifest.get("version"), manifest.get("kind"))
    if found != (MANIFEST_FORMAT, MANIFEST_VERSION, kind):
        raise CheckpointError(
            f"{path}: format/version/kind {found}, expected "
            f"{(MANIFEST_FORMAT, MANIFEST_VERSION, kind)}"
        )
    problems = file_problems(folder, manifest["files"], exclude=[MANIFEST])
    if problems:
        raise CheckpointError(f"checkpoint {folder} fails its manifest: " + "; ".join(problems))
    return manifest


# ------------------------------------------------------------- safe tensor files


def load_tensor_file(path: Path, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, dicts, lists, tuples and plain
    values only.  A pickle that asks for anything else (a class, a function: what an
    attack's ``__reduce__`` needs) is refused before it runs, as a :class:`CheckpointError`
    naming the file; so is an unreadable or truncated file.

    ``mmap=True`` maps the tensors from the file instead of reading them into memory: a
    caller that copies them into tensors it already holds (a resume) then needs no second
    copy of the state in anonymous memory, only page cache the kernel can drop."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(str(exc))
        if "global" in reason.lower():
            raise CheckpointError(
                f"refusing to load {path}: it is not a plain tensor file, and its pickle "
                f"names objects that could run code ({reason})"
            ) from None
        raise CheckpointError(f"cannot read {path} (damaged?): {reason}") from None
    except Exception as exc:  # truncated, not a torch file, missing
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def _unpickler_reason(message: str) -> str:
    """The informative lines of torch's weights_only error, without its boilerplate (which
    suggests ``weights_only=False``, the very thing not to do with an untrusted file)."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    body = message.replace("WeightsUnpickler error:", "")
    lines = [line.strip() for line in body.splitlines()]
    kept = [line for line in lines if line and not line.startswith(boilerplate)]
    return " ".join(kept) or message.strip()
