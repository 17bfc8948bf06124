"""``hybridflow plan``: the recipe schema, the argparse wiring and the printed plans."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hf_core.planner.cli import add_plan_command, run_plan
from hf_core.planner.recipe import load_recipe

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "plan_ppo_7b.yaml"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybridflow")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_example_recipe_plans(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["plan", str(EXAMPLE), "--nodes", "2", "--device", "a100-80g", "--top", "2"])
    assert args.handler is run_plan
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "best plans" in out and "actor" in out and "s/iteration" in out


def test_json_output_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", str(EXAMPLE), "workload.global_batch=256", "--json", "--nodes", "1"]
    assert run_plan(_parse([*argv, "--set", "algorithm=grpo"])) == 2  # PPO's critic is extra
    assert "unknown ['critic']" in capsys.readouterr().err
    assert run_plan(_parse(argv)) == 0
    placement = json.loads(capsys.readouterr().out)
    assert sum(pool["devices"] for pool in placement["pools"]) == 8
    assert placement["cluster"]["nodes"] == 1


def test_recipe_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: ppo\nmodels: {actor: llama2-7b}\nworkload: {global_batch: -1}\n")
    with pytest.raises(ValueError, match=r"workload\.global_batch"):
        load_recipe(bad)
    assert run_plan(_parse(["plan", str(bad)])) == 2
    assert "workload.global_batch" in capsys.readouterr().err


def test_too_big_model_is_a_clean_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(
        ["plan", str(EXAMPLE), "models.actor=llama2-70b", "--nodes", "1", "--devices-per-node", "2"]
    )
    assert run_plan(args) == 2
    err = capsys.readouterr().err
    assert "actor" in err and "GiB" in err


def test_hf_config_path_relative_to_recipe(tmp_path: Path) -> None:
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "vocab_size": 32000,
            }
        )
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "algorithm: grpo\nmodels: {actor: llama2-7b, reference: llama2-7b, reward: rm}\n"
    )
    specs = load_recipe(recipe).model_specs()
    assert specs["reward"].num_kv_heads == 4 and specs["reward"].num_layers == 22
