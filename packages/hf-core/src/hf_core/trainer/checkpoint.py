"""Run checkpoints: engines + trainer state in one folder, made visible atomically.

Layout: ``<output_dir>/checkpoints/step_<k>/`` holding each engine's folder (``actor/``,
``critic/``) and ``trainer_state.pt``; ``checkpoints/latest`` names the newest complete one.
Everything is written into ``step_<k>.partial`` first and renamed when complete, then
``latest`` is replaced atomically, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hf_core.errors import CheckpointError


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def save_run_checkpoint(
    output_dir: Path, step: int, state: dict[str, Any], save_engines: Callable[[Path], None]
) -> Path:
    root = checkpoints_dir(output_dir)
    final = root / f"step_{step}"
    partial = root / f"step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_engines(partial)
    torch.save(state, partial / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    return final


def latest_checkpoint(output_dir: Path) -> Path:
    root = checkpoints_dir(output_dir)
    pointer = root / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint to resume from: {pointer} does not exist")
    folder = root / pointer.read_text().strip()
    if not (folder / "trainer_state.pt").is_file():
        raise CheckpointError(f"checkpoint {folder} is incomplete (no trainer_state.pt)")
    return folder


def load_trainer_state(folder: Path) -> dict[str, Any]:
    try:
        return torch.load(folder / "trainer_state.pt", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(f"cannot read {folder / 'trainer_state.pt'}: {exc}") from exc
