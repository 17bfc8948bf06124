"""Bad inputs fail with errors that name what and where, and leave no half-written output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RECIPES

from hf_core.cli import main


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", str(RECIPES / "grpo.yaml"), "run.progress=false", *args])
    return code, " ".join(capsys.readouterr().err.split())


def _nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_unknown_key(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_workdir / "runs" / "bad_key"
    code, err = _run_cli(capsys, f"run.output_dir={out}", "actor.lrr=1")
    assert code == 2
    assert "actor.lrr: unknown key" in err
    _nothing_written(out)


def test_wrong_type(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_workdir / "runs" / "bad_type"
    code, err = _run_cli(capsys, f"run.output_dir={out}", "rollout.n=many")
    assert code == 2
    assert "rollout.n: got 'many'" in err and "valid integer" in err
    _nothing_written(out)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("actor.engine.lrr=1", "actor.engine.lrr: unknown key"),
        ("actor.engine.lr=-1", "actor.engine.lr: got -1"),
        ("rollout.engine.max_new_tokenz=3", "rollout.engine.max_new_tokenz: unknown key"),
        ("actor.backend=fsdpp", "did you mean 'fsdp'"),
        ("algorithm.advantage=grpoo", "did you mean 'grpo'"),
    ],
)
def test_engine_settings_checked_before_ray_starts(
    in_workdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    override: str,
    named: str,
) -> None:
    import ray

    started: list[object] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    out = in_workdir / "runs" / "bad_engine_key"
    code, err = _run_cli(capsys, f"run.output_dir={out}", override)
    assert code == 2, err
    assert named in err
    assert "Traceback" not in err and "[bold" not in err
    assert not started, "Ray was started before the configuration was checked"
    _nothing_written(out)


def test_missing_dataset(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_workdir / "runs" / "no_data"
    code, err = _run_cli(capsys, f"run.output_dir={out}", "data.train_files=[nowhere.jsonl]")
    assert code == 2
    assert "nowhere.jsonl" in err
    _nothing_written(out)


def test_malformed_jsonl_line(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_workdir / "runs" / "bad_jsonl"
    broken = in_workdir / "broken.jsonl"
    lines = (in_workdir / "runs" / "assets" / "train.jsonl").read_text().splitlines()[:5]
    lines[3] = '{"prompt": "reverse 123:", "ground_truth": '
    broken.write_text("\n".join(lines) + "\n")
    code, err = _run_cli(capsys, f"run.output_dir={out}", f"data.train_files=[{broken}]")
    assert code == 2
    assert "broken.jsonl" in err and "line 4" in err
    _nothing_written(out)


@pytest.mark.usefixtures("ray_cluster")
def test_reward_function_that_raises(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_workdir / "runs" / "bad_reward"
    code, err = _run_cli(
        capsys,
        f"run.output_dir={out}",
        "reward.function=bad_rewards:explode_on_long",
        "run.total_steps=2",
    )
    assert code == 2
    assert "bad_rewards:explode_on_long" in err or "explode_on_long" in err
    assert "sample 0" in err and "cannot score this" in err
    assert not (out / "checkpoints").exists()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # only complete rows, if any
