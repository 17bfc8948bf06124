"""Run checkpoints: manifests, pickle refusal, retention, the trainer state round trip."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_core.algorithms import LagrangeMultiplier, make_kl_controller
from hf_core.atomic import MANIFEST, load_tensor_file, read_manifest, write_manifest
from hf_core.data import PromptDataset, PromptLoader, write_jsonl
from hf_core.errors import CheckpointError, DiskFullError
from hf_core.rng import rng_state, set_rng_state
from hf_core.trainer.checkpoint import (
    KIND,
    STATE_JSON,
    STATE_TENSORS,
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_run_checkpoint,
    write_trainer_state,
)


class _Exploit:
    """A pickle payload: unpickling it calls ``os.system`` (here: touch a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _fake_engines(folder: Path) -> None:
    """What the actor and critic groups write: one folder each, with a few files."""
    for role in ("actor", "critic"):
        (folder / role / "dcp").mkdir(parents=True)
        torch.save({"w": torch.arange(6.0)}, folder / role / "dcp" / "shard.pt")
        (folder / role / "engine.json").write_text(json.dumps({"role": role}))


def _state(step: int = 3) -> dict:
    return {"step": step, "loader": {"epoch": 1, "offset": 0}, "rng": rng_state()}


def _save(out: Path, step: int, keep: int | None = None) -> Path:
    return save_run_checkpoint(out, step, _state(step), _fake_engines, keep=keep)


# ------------------------------------------------------------------ manifests


def test_manifest_covers_every_file_and_is_written_last(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    assert folder == tmp_path / "checkpoints" / "step_3"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_3"
    assert not (tmp_path / "checkpoints" / "step_3.partial").exists()
    manifest = read_manifest(folder, KIND)
    assert manifest["step"] == 3
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [n for n in on_disk if n != MANIFEST]
    assert {"actor/dcp/shard.pt", "critic/engine.json", STATE_JSON, STATE_TENSORS} <= set(
        manifest["files"]
    )
    entry = manifest["files"]["actor/dcp/shard.pt"]
    assert entry["size"] == (folder / "actor/dcp/shard.pt").stat().st_size
    assert len(entry["sha256"]) == 64
    assert latest_checkpoint(tmp_path) == folder


def test_tampered_file_is_refused_by_name(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    target = folder / "actor" / "engine.json"
    target.write_text(target.read_text().replace("actor", "ACTOR"))  # same size
    with pytest.raises(CheckpointError, match=r"actor/engine\.json does not match its sha256"):
        latest_checkpoint(tmp_path)


def test_truncated_file_is_refused_by_name(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    shard = folder / "critic" / "dcp" / "shard.pt"
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"critic/dcp/shard\.pt is 50 bytes, expected"):
        latest_checkpoint(tmp_path)


def test_missing_and_unlisted_files_are_refused(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    (folder / STATE_TENSORS).unlink()
    (folder / "actor" / "extra.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path)
    assert f"{folder / STATE_TENSORS} is missing" in str(info.value)
    assert f"{folder / 'actor' / 'extra.pt'} is not in the manifest" in str(info.value)


def test_foreign_checkpoints_are_refused(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    (folder / MANIFEST).unlink()  # an old-format or half-copied checkpoint
    with pytest.raises(CheckpointError, match=rf"{folder / MANIFEST} does not exist"):
        latest_checkpoint(tmp_path)
    (folder / MANIFEST).write_text(json.dumps({"format": "something-else", "files": {}}))
    with pytest.raises(CheckpointError, match=r"manifest\.json: format/version/kind"):
        latest_checkpoint(tmp_path)
    (folder / MANIFEST).write_text("not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable"):
        latest_checkpoint(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("x")
    write_manifest(other, "some-engine")
    with pytest.raises(CheckpointError, match="'some-engine'"):
        read_manifest(other, KIND)


def test_latest_pointer_problems_are_clear(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint to resume from: .*latest"):
        latest_checkpoint(tmp_path)
    _save(tmp_path, 3)
    (tmp_path / "checkpoints" / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match="not a step_<k> folder"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("step_9")
    with pytest.raises(CheckpointError, match=r"step_9, which does not exist"):
        latest_checkpoint(tmp_path)


def test_crashed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 3)

    def crash(folder: Path) -> None:
        _fake_engines(folder)
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="simulated"):
        save_run_checkpoint(tmp_path, 6, _state(6), crash)
    assert not (tmp_path / "checkpoints" / "step_6.partial").exists()  # nothing half-written
    assert latest_checkpoint(tmp_path).name == "step_3"


def test_a_killed_saves_leftover_goes_when_the_next_run_starts(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    leftover = tmp_path / "checkpoints" / "step_6.partial"
    _fake_engines(leftover)  # what a save killed mid-write leaves
    assert remove_partial_checkpoints(tmp_path) == [leftover]
    assert not leftover.exists() and latest_checkpoint(tmp_path).name == "step_3"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a real disk that fills up (needs root to mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_is_a_clear_error_and_keeps_the_last_checkpoint(
    small_disk: Path,
) -> None:
    _save(small_disk, 3)

    def big_engines(folder: Path) -> None:  # more than the disk has left
        (folder / "actor").mkdir()
        (folder / "actor" / "shard.bin").write_bytes(os.urandom(3 * 2**20))

    with pytest.raises(DiskFullError, match=r"step 6 .*no space left on device") as info:
        save_run_checkpoint(small_disk, 6, _state(6), big_engines)
    assert "(step_3) is intact" in str(info.value)
    assert re.search(r"a checkpoint of this run takes \d+ KiB; \d\.\d MiB free", str(info.value))
    assert not (small_disk / "checkpoints" / "step_6.partial").exists()
    assert load_trainer_state(latest_checkpoint(small_disk))["step"] == 3
    _save(small_disk, 9, keep=1)  # the space came back: the next save fits
    assert latest_checkpoint(small_disk).name == "step_9"


def test_a_full_disk_that_torch_reports_without_an_errno_is_still_a_full_disk(
    small_disk: Path,
) -> None:
    """torch's zip writer turns ENOSPC into "unexpected pos ...": the free space tells."""
    _save(small_disk, 3)

    def torch_engines(folder: Path) -> None:
        (folder / "actor").mkdir()
        torch.save({"w": torch.zeros(2**20)}, folder / "actor" / "shard.pt")  # 4 MiB

    with pytest.raises(DiskFullError, match=r"step 6 .*no space left on device") as info:
        save_run_checkpoint(small_disk, 6, _state(6), torch_engines)
    assert "unexpected pos" in str(info.value.__cause__)  # the error torch gave
    assert not (small_disk / "checkpoints" / "step_6.partial").exists()
    assert latest_checkpoint(small_disk).name == "step_3"


# --------------------------------------------------------------- pickle refusal


@pytest.mark.parametrize("mmap", [False, True])
def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path, mmap: bool) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"rng": _Exploit(marker)}, evil)
    with pytest.raises(CheckpointError, match=rf"refusing to load {evil}"):
        load_tensor_file(evil, mmap=mmap)
    assert not marker.exists()


def test_a_malicious_trainer_state_is_refused_even_with_a_matching_manifest(
    tmp_path: Path,
) -> None:
    """The manifest guards against damage, not against someone who rewrites it too: the
    loader itself must never run a pickle's code."""
    folder = _save(tmp_path, 3)
    marker = tmp_path / "pwned"
    torch.save({"rng/torch": _Exploit(marker)}, folder / STATE_TENSORS)
    write_manifest(folder, KIND, step=3)
    found = latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=rf"refusing to load {folder / STATE_TENSORS}"):
        load_trainer_state(found)
    assert not marker.exists()


@pytest.mark.parametrize("mmap", [False, True])
def test_garbage_tensor_file_names_the_file(tmp_path: Path, mmap: bool) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match=rf"cannot read {bad}"):
        load_tensor_file(bad, mmap=mmap)


def test_a_mapped_load_reads_the_tensors_without_writing_the_file(tmp_path: Path) -> None:
    """A resume maps its rank file: the values are the saved ones, and the tensors it later
    updates in place (optimizer state) must not write through to the checkpoint."""
    file = tmp_path / "state.pt"
    torch.save({"w": torch.arange(6.0), "step": 3}, file)
    before = file.read_bytes()
    state = load_tensor_file(file, mmap=True)
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(6.0))
    state["w"].add_(1.0)
    assert file.read_bytes() == before


# --------------------------------------------------------------------- retention


def test_retention_keeps_the_newest_and_removes_partials(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3", "step_4"]
    (root / "step_5.partial").mkdir()  # a crashed save's leftover
    _save(tmp_path, 10, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_10", "step_4"]


def test_retention_never_deletes_what_latest_names(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)
    (root / "latest").write_text("step_2")  # e.g. a run resumed from an older checkpoint
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_1", "step_3"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_4", "step_5"]
    assert latest_checkpoint(tmp_path).name == "step_2"
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, keep=0)


# ------------------------------------------------------------ trainer state


def _draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.randn(3).tolist(),  # uses numpy's cached gaussian
        torch.rand(3).tolist(),
    )


def test_trainer_state_round_trips_through_json_and_tensors(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # python keeps a cached gaussian
    np.random.randn()  # numpy does too (has_gauss)
    kl = make_kl_controller("adaptive", kl_coef=0.05, target_kl=6.0, horizon=100)
    kl.update(3.0, 8)
    lagrange = LagrangeMultiplier(0.5, lr=0.1, cost_limit=0.0)
    state = {
        "step": 7,
        "loader": {"version": 1, "epoch": 2, "offset": 8, "seed": 0, "shuffle": True},
        "kl_ctl": kl.state_dict(),
        "lagrange": lagrange.state_dict(),
        "rng": rng_state(),
    }
    expected = _draws()
    write_trainer_state(tmp_path, state)
    assert json.loads((tmp_path / STATE_JSON).read_text())["state"]["step"] == 7
    _draws()  # move every generator on

    loaded = load_trainer_state(tmp_path)
    set_rng_state(loaded["rng"])
    assert _draws() == expected
    assert {k: loaded[k] for k in ("step", "loader", "kl_ctl", "lagrange")} == {
        k: state[k] for k in ("step", "loader", "kl_ctl", "lagrange")
    }
    restored = make_kl_controller("adaptive", kl_coef=0.0, target_kl=6.0, horizon=100)
    restored.load_state_dict(loaded["kl_ctl"])
    assert restored.value == kl.value


def test_trainer_state_refuses_values_json_cannot_keep(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"trainer state loader/pos: tuple is not JSON"):
        write_trainer_state(tmp_path, {"loader": {"pos": (1, 2)}})
    (tmp_path / STATE_JSON).write_text(json.dumps({"format": "other", "state": {}}))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / STATE_JSON} is not a"):
        load_trainer_state(tmp_path)


# ------------------------------------------------- loader: resume at an epoch end


@pytest.mark.parametrize(("n", "drop_last"), [(12, True), (14, True), (14, False)])
def test_loader_resumed_at_an_epoch_end_continues_into_the_next_epoch(
    tmp_path: Path, n: int, drop_last: bool
) -> None:
    """Stopping right after an epoch's last batch, saving through the trainer state files
    and resuming in a fresh loader yields the next epoch in the uninterrupted order."""
    pytest.importorskip("tokenizers")
    from hf_testing.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    path = write_jsonl([{"prompt": f"reverse {i}{i}:"} for i in range(n)], tmp_path / "d.jsonl")

    def loader() -> PromptLoader:
        dataset = PromptDataset.from_files(path, tokenizer)
        return PromptLoader(dataset, 4, seed=5, drop_last=drop_last, num_epochs=3)

    full = [b["sample_index"].tolist() for b in loader()]
    first = loader()
    per_epoch = len(first)
    for _ in range(per_epoch):
        next(first)
    assert first.epoch == 1
    write_trainer_state(tmp_path, {"loader": first.state_dict()})
    resumed = loader()
    resumed.load_state_dict(load_trainer_state(tmp_path)["loader"])
    rest = [b["sample_index"].tolist() for b in resumed]
    assert rest == full[per_epoch:]
    assert len(rest) == 2 * per_epoch
