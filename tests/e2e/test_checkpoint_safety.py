"""A real run's checkpoints: retention, a manifest over every file, and refusals.

One GRPO run saves every step and keeps two checkpoints; its newest checkpoint is then
tampered with (``--resume`` must refuse it, naming the file), and pickles that would run code
are planted in the actor's FSDP checkpoint (the engine must refuse them, running nothing).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import RECIPES

from hf_core.atomic import read_manifest, write_manifest
from hf_core.config import TrainerConfig, load_config
from hf_core.errors import CheckpointError
from hf_core.trainer import RLTrainer
from hf_core.trainer.checkpoint import KIND
from hf_fsdp import checkpoint as fsdp_checkpoint
from hf_fsdp.engine import FSDPEngine


class _Exploit:
    """Unpickling this runs ``touch <marker>``: what an attacker's checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _config(out: Path, steps: int) -> TrainerConfig:
    return load_config(
        TrainerConfig,
        RECIPES / "grpo.yaml",
        [
            f"run.output_dir={out}",
            f"run.total_steps={steps}",
            "run.save_every=1",
            "run.keep_checkpoints=2",
            "run.val_every=0",
            "run.progress=false",
        ],
    )


@pytest.fixture(scope="module")
def run_dir(workdir: Path, ray_cluster: None) -> Path:
    """A 3-step run saving every step, keeping 2 checkpoints."""
    out = workdir / "runs" / "safety"
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        RLTrainer(_config(out, 3)).fit()
    finally:
        os.chdir(cwd)
    return out


def test_retention_keeps_the_newest_two(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    assert (root / "latest").read_text() == "step_3"


def test_run_manifest_covers_the_engine_files(run_dir: Path) -> None:
    folder = run_dir / "checkpoints" / "step_3"
    files = read_manifest(folder, KIND)["files"]
    assert {"trainer_state.json", "trainer_tensors.pt", "actor/engine.pt"} <= set(files)
    assert any(name.startswith("actor/dcp/") for name in files)
    assert not list(folder.rglob("*.pkl"))


def _copy_run(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


@pytest.mark.usefixtures("ray_cluster")
def test_resume_refuses_a_tampered_checkpoint(
    run_dir: Path, tmp_path: Path, in_workdir: Path
) -> None:
    out = _copy_run(run_dir, tmp_path)
    shard = next((out / "checkpoints" / "step_3" / "actor" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard} does not match its sha256"):
        RLTrainer(_config(out, 4), resume=True).fit()


def _plant(folder: Path, name: str, payload: object) -> None:
    """Replace ``folder/name`` and rewrite both manifests, as someone who controls the
    files could: only the safe loading stands between the file and the code in it."""
    torch.save(payload, folder / name)
    engine_manifest = folder / fsdp_checkpoint.MANIFEST
    info = json.loads(engine_manifest.read_text())
    info["files"][name] = (folder / name).stat().st_size
    info["world_size"] = 1  # so this one-process engine reads rank 0's RNG file
    engine_manifest.write_text(json.dumps(info))
    write_manifest(folder.parent, KIND, step=3)


@pytest.mark.parametrize("name", ["engine.pt", "rng-rank00000.pt"])
def test_engine_refuses_pickles_that_run_code(
    run_dir: Path, tmp_path: Path, in_workdir: Path, name: str
) -> None:
    out = _copy_run(run_dir, tmp_path)
    actor = out / "checkpoints" / "step_3" / "actor"
    marker = tmp_path / "pwned"
    _plant(actor, name, {"step": 3, "scheduler": None, "torch": _Exploit(marker)})
    assert read_manifest(actor.parent, KIND)  # the manifests agree with the planted file
    engine = FSDPEngine({"model_path": str(in_workdir / "runs/assets/policy"), "lr": 1e-4})
    with pytest.raises(CheckpointError, match=rf"refusing to load {actor / name}"):
        engine.load_checkpoint(actor)
    assert not marker.exists()


def test_engine_refuses_dcp_metadata_that_runs_code(
    run_dir: Path, tmp_path: Path, in_workdir: Path
) -> None:
    """DCP reads ``.metadata`` with plain pickle; the engine checks it first."""
    out = _copy_run(run_dir, tmp_path)
    actor = out / "checkpoints" / "step_3" / "actor"
    marker = tmp_path / "pwned"
    metadata = actor / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Exploit(marker)))
    info = json.loads((actor / fsdp_checkpoint.MANIFEST).read_text())
    info["files"]["dcp/.metadata"] = metadata.stat().st_size
    (actor / fsdp_checkpoint.MANIFEST).write_text(json.dumps(info))
    engine = FSDPEngine({"model_path": str(in_workdir / "runs/assets/policy"), "lr": 1e-4})
    with pytest.raises(CheckpointError, match=rf"refusing to load {metadata}: .*posix.system"):
        engine.load_checkpoint(actor)
    assert not marker.exists()
