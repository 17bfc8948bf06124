"""Environment libraries end to end: the reasoning-gym demo's recipe on a tiny model for a few
steps (the default session's short version of ``python recipes/reasoning_gym_demo.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RECIPES, load_script

pytest.importorskip("reasoning_gym")


@pytest.mark.usefixtures("ray_cluster")
def test_the_reasoning_gym_demo_runs(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_script(RECIPES / "reasoning_gym_demo.py")
    out = in_workdir / "runs" / "reasoning_gym_short"
    code = demo.main(
        [
            "run.total_steps=3",
            "run.val_every=3",
            "run.progress=false",
            "sft.steps=2",
            "env.size=96",
            "env.val_size=16",
            f"run.output_dir={out}",
        ]
    )
    assert code in (0, 1)  # 3 steps cannot show the +0.2 the full demo does
    printed = capsys.readouterr().out
    assert "basic_arithmetic" in printed and "reasoning-gym demo:" in printed, printed[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(0.0 <= row["env/basic_arithmetic/reward"] <= 1.0 for row in rows)
    assert rows[-1]["val/env/basic_arithmetic/count"] == 16
