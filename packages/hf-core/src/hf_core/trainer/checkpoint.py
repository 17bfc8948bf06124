"""Run checkpoints: engines + trainer state in one folder, verified, made visible atomically.

Layout::

    <output_dir>/checkpoints/
        latest                      the name of the newest complete checkpoint ("step_6")
        step_<k>/
            actor/, critic/         each engine's own checkpoint folder
            trainer_state.json      step, loader position, KL controller, Lagrange
                                    multiplier, python/numpy RNG: plain JSON
            trainer_tensors.pt      the state's tensors (torch's RNG bytes, numpy's key
                                    array), read back with ``weights_only=True``
            manifest.json           size + sha256 of every file above, written last

Everything is written into ``step_<k>.partial`` first and renamed when complete, then
``latest`` is replaced atomically, so a crash mid-save leaves the previous checkpoint intact;
a save that fails removes its ``.partial`` at once, and one whose disk filled up is a
:class:`DiskFullError` saying how much room a checkpoint takes and how much is free.
Nothing is unpickled beyond plain tensors, and a folder is read only after every file matches
its manifest: a truncated, altered or foreign checkpoint is a :class:`CheckpointError` naming
the file.  After a save, the oldest ``step_*`` folders beyond ``keep`` are deleted (never the
one ``latest`` names), with any ``.partial`` leftover of a crashed save.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hf_core.atomic import load_tensor_file, read_manifest, write_manifest
from hf_core.errors import CheckpointError, DiskFullError

log = logging.getLogger(__name__)

KIND = "run-checkpoint"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_tensors.pt"
STATE_FORMAT = "hybridflow-trainer-state"
STATE_VERSION = 1
_STEP = re.compile(r"step_(\d+)")
_TENSOR = "__tensor__"  # marks where a tensor from STATE_TENSORS goes back in the JSON tree
FULL_DISK_BYTES = 2**20
"""A save that fails while its disk has less room than this ran out of space, whatever its
error says: torch's zip writer reports a full disk as "unexpected pos ...", with no errno."""


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


# ------------------------------------------------------------ trainer state


def _split_tensors(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with every tensor moved into ``tensors`` (keyed by its path) and replaced
    by a marker; anything that JSON cannot hold exactly is an error naming its path."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu()
        return {_TENSOR: path}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"trainer state {path or '<root>'}: dict keys must be strings")
        return {
            k: _split_tensors(v, f"{path}/{k}" if path else k, tensors) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_split_tensors(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"trainer state {path}: {type(value).__name__} is not JSON or a tensor "
        "(convert it in the state_dict, e.g. tuples to lists, arrays to tensors)"
    )


def _join_tensors(value: Any, tensors: dict[str, torch.Tensor], file: Path) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            if value[_TENSOR] not in tensors:
                raise CheckpointError(f"{file} lacks the tensor {value[_TENSOR]!r}")
            return tensors[value[_TENSOR]]
        return {k: _join_tensors(v, tensors, file) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_tensors(v, tensors, file) for v in value]
    return value


def write_trainer_state(folder: Path, state: dict[str, Any]) -> None:
    """``state`` as ``trainer_state.json`` plus its tensors in ``trainer_tensors.pt``."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _split_tensors(state, "", tensors)
    doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "state": tree}
    (folder / STATE_JSON).write_text(json.dumps(doc, indent=1))
    torch.save(tensors, folder / STATE_TENSORS)


def load_trainer_state(folder: Path) -> dict[str, Any]:
    """Read what :func:`write_trainer_state` wrote (the folder's manifest is checked by
    :func:`latest_checkpoint`); never unpickles anything but tensors."""
    file = folder / STATE_JSON
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from None
    if not isinstance(doc, dict) or (doc.get("format"), doc.get("version")) != (
        STATE_FORMAT,
        STATE_VERSION,
    ):
        raise CheckpointError(f"{file} is not a {STATE_FORMAT} version {STATE_VERSION} file")
    tensors = load_tensor_file(folder / STATE_TENSORS)
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{folder / STATE_TENSORS} does not hold a dict of tensors")
    state: dict[str, Any] = _join_tensors(doc["state"], tensors, folder / STATE_TENSORS)
    return state


# --------------------------------------------------------------- save / load


def save_run_checkpoint(
    output_dir: Path,
    step: int,
    state: dict[str, Any],
    save_engines: Callable[[Path], None],
    *,
    keep: int | None = None,
) -> Path:
    """Write ``step_<step>`` (engines, trainer state, manifest last), make it ``latest``,
    then keep only the newest ``keep`` checkpoints (``None``: keep all)."""
    root = checkpoints_dir(output_dir)
    final = root / f"step_{step}"
    partial = root / f"step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        save_engines(partial)
        write_trainer_state(partial, state)
        write_manifest(partial, KIND, step=step)
    except BaseException as exc:
        full = isinstance(exc, Exception) and _disk_full(exc, root)  # while the bytes are there
        written = _bytes_under(partial) if full else 0
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written stays, nor its bytes
        if full:
            raise DiskFullError(_disk_full_message(root, step, written)) from exc
        raise
    if final.exists():  # the same step saved again (a resumed run): replace it
        shutil.rmtree(final)
    os.replace(partial, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    if keep is not None:
        prune_checkpoints(output_dir, keep)
    return final


def _disk_full(exc: Exception, root: Path) -> bool:
    """ENOSPC here, or in a worker (its error carries the message, not the errno), or any
    error while the disk has (almost) no room left (see FULL_DISK_BYTES)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    if os.strerror(errno.ENOSPC) in str(exc):
        return True
    free = _free_bytes(root)
    return free is not None and free < FULL_DISK_BYTES


def _disk_full_message(root: Path, step: int, written: int) -> str:
    """What failed, how much room a checkpoint takes against what is free, what is intact."""
    latest = _latest_name(root)
    free = _free_bytes(root)
    if latest is not None and (root / latest).is_dir():
        needs = f"a checkpoint of this run takes {_size(_bytes_under(root / latest))}"
    else:
        needs = f"the disk filled up {_size(written)} into it"
    have = "unknown" if free is None else _size(free)
    return (
        f"the checkpoint of step {step} could not be written to {root}: no space left on device "
        f"({needs}; {have} free now that the incomplete step_{step}.partial is removed). "
        f"The previous checkpoint ({latest or 'none yet'}) is intact and loadable (--resume). "
        "Free space, move run.output_dir to a larger disk or lower run.keep_checkpoints, "
        "then resume"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _bytes_under(folder: Path) -> int:
    """:func:`folder_bytes`, or 0 where files vanish under it (a rank still cleaning up)."""
    try:
        return folder_bytes(folder)
    except OSError:
        return 0


def remove_partial_checkpoints(output_dir: Path) -> list[Path]:
    """Delete every ``step_*.partial`` a crashed or failed save left (a run does this when it
    starts, so leftovers never outlive the next start); returns what went."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir() if p.is_dir() and _is_partial(p.name)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed an incomplete checkpoint %s", path)
    return removed


def _is_partial(name: str) -> bool:
    return name.startswith("step_") and name.endswith(".partial")


def _latest_name(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def prune_checkpoints(output_dir: Path, keep: int) -> list[Path]:
    """Delete ``step_*`` folders beyond the newest ``keep`` (by step number), never the one
    ``latest`` names, and every ``step_*.partial`` a crashed save left; returns what went."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    latest = _latest_name(root)
    steps = []
    removed = []
    for entry in root.iterdir():
        match = _STEP.fullmatch(entry.name)
        if entry.is_dir() and match:
            steps.append((int(match.group(1)), entry))
        elif entry.is_dir() and _is_partial(entry.name):
            removed.append(entry)
    steps.sort(reverse=True)
    removed += [path for _, path in steps[keep:] if path.name != latest]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed old checkpoint %s", path)
    return removed


def latest_checkpoint(output_dir: Path) -> Path:
    """The checkpoint ``latest`` names, after checking every file against its manifest."""
    root = checkpoints_dir(output_dir)
    name = _latest_name(root)
    if name is None:
        raise CheckpointError(f"no checkpoint to resume from: {root / 'latest'} does not exist")
    if not _STEP.fullmatch(name):
        raise CheckpointError(f"{root / 'latest'} names {name!r}, not a step_<k> folder")
    folder = root / name
    if not folder.is_dir():
        raise CheckpointError(f"{root / 'latest'} names {folder}, which does not exist")
    read_manifest(folder, KIND)
    return folder


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (a checkpoint's size on disk)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
