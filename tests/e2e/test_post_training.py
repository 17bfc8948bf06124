"""The supervised and preference trainers end to end: every recipe runs 3 steps on FSDP (SFT
and reward-model training also on megatron), data parallelism equals one process, a resumed
run equals an uninterrupted one, and the exported model loads where the next stage reads it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import LONG, POST_TRAINING, RECIPES, exported_weights, load_script

from hf_core.config import TrainerConfig, load_config
from hf_core.engines.adapters import DEFAULT_TARGETS
from hf_core.trainer import trainer_class
from hf_core.trainer.preflight import load_run_config

HEADLINE = {
    "sft": ["actor/sft_nll", "actor/grad_norm", "sft/target_tokens", "val/nll", "val/perplexity"],
    "reward_model": [
        "reward_model/loss",
        "reward_model/pair_accuracy",
        "reward_model/score_margin",
        "reward_model/grad_norm",
        "val/pair_accuracy",
        "val/score_margin",
    ],
    "dpo": [
        "dpo/loss",
        "dpo/rewards/chosen",
        "dpo/rewards/rejected",
        "dpo/rewards/margin",
        "dpo/rewards/accuracy",
        "dpo/grad_norm",
        "val/rewards/accuracy",
        "val/loss",
    ],
}
MEGATRON = {
    "sft": ["actor.backend=megatron", "actor.parallel.tp=2"],
    "reward_model": ["reward.model.backend=megatron", "reward.model.parallel.tp=2"],
}
"""SFT and reward-model training on megatron-core (TP=2 over the recipe's two ranks)."""
CASES = [*POST_TRAINING, *(f"{name}@megatron" for name in MEGATRON)]


def _run(name: str, out: Path, *overrides: str) -> list[dict]:
    recipe, _, backend = name.partition("@")
    config, layout = load_run_config(
        RECIPES / f"{recipe}.yaml",
        [
            "run.total_steps=3",
            "run.val_every=3",
            "run.progress=false",
            f"run.output_dir={out}",
            *(MEGATRON[recipe] if backend else []),
            *overrides,
        ],
    )
    trainer_class(config)(config, layout=layout).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", CASES)
def test_trainer_recipe_runs_three_steps(name: str, in_workdir: Path) -> None:
    out = in_workdir / "runs" / name.replace("@", "-")
    rows = _run(name, out, "run.export_final=true")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in HEADLINE[name.partition("@")[0]]:
        assert key in rows[-1], f"{name}: no {key} at step 3"
    for row in rows:
        for key, value in row.items():
            if isinstance(value, int | float):
                assert math.isfinite(value), f"{name}: {key} = {value} at step {row['step']}"
    first, last = rows[0], rows[-1]
    if name.startswith("sft"):
        assert last["actor/sft_nll"] < first["actor/sft_nll"], "SFT did not lower the NLL"
    if name.startswith("reward_model"):
        assert last["reward_model/loss"] < first["reward_model/loss"], "BT loss did not fall"
    # the export is what the next stage reads: the RL policy, or a PPO recipe's reward model
    if name.startswith("reward_model"):
        load_run_config(RECIPES / "ppo.yaml", [f"reward.model.model_path={out / 'reward_hf'}"])
    else:
        load_run_config(RECIPES / "grpo.yaml", [f"model.path={out / 'actor_hf'}"])


DATA_PARALLEL = {
    # name: (loss, gradient norm, the trained role's engine key, its export folder)
    "sft": ("actor/sft_nll", "actor/grad_norm", "actor.engine", "actor_hf"),
    "reward_model": (
        "reward_model/loss",
        "reward_model/grad_norm",
        "reward.model.engine",
        "reward_hf",
    ),
    "dpo": ("dpo/loss", "dpo/grad_norm", "actor.engine", "actor_hf"),
}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(
    "name", [pytest.param("sft", marks=LONG), pytest.param("reward_model", marks=LONG), "dpo"]
)
def test_two_ranks_equal_one(name: str, in_workdir: Path) -> None:
    """The same steps on 1 and 2 data-parallel ranks: losses, gradient norms and weights
    agree (pairs split over ranks and micro-batches: the Bradley-Terry and DPO pair losses are
    exact anyway)."""
    loss, grad_norm, engine, export = DATA_PARALLEL[name]
    runs, weights = {}, {}
    for processes in (1, 2):
        out = in_workdir / "runs" / f"{name}-dp{processes}"
        runs[processes] = _run(
            name,
            out,
            f"placement.processes={processes}",
            f"{engine}.micro_batch_size=4",  # several micro-batches per rank
            "run.export_final=true",
        )
        weights[processes] = exported_weights(out, export)
    for one, two in zip(runs[1], runs[2], strict=True):
        for key in (loss, grad_norm):
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    # Adam divides by sqrt(v): where a gradient is ~0, a summation-order difference of 1e-9
    # moves a weight by up to ~1% of one step (lr 1e-3), so weights agree to 1e-5, not 1e-6
    assert weights[1].keys() == weights[2].keys() and weights[1]
    for key, tensor in weights[1].items():
        torch.testing.assert_close(weights[2][key], tensor, rtol=1e-4, atol=1e-5)


STARTING_MODEL = {"sft": "policy", "reward_model": "reward", "dpo": "policy"}
"""The folder under ``runs/assets`` each recipe's trained role starts from."""


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", POST_TRAINING)
def test_lora_trains_only_the_adapters(name: str, in_workdir: Path) -> None:
    """3 steps with rank-4 LoRA adapters on every projection: the loss falls (SFT, reward
    model) and the merged export moved exactly the adapted projections (and a reward model's
    score head, which trains whole); embeddings and norms are the starting weights."""
    loss, _, engine, export = DATA_PARALLEL[name]
    out = in_workdir / "runs" / f"{name}-lora"
    rows = _run(
        name, out, f"{engine}.lora={{rank: 4}}", f"{engine}.lr=5e-3", "run.export_final=true"
    )
    assert all(math.isfinite(row[loss]) for row in rows)
    if name != "dpo":  # DPO's first step is log(2) exactly; its later ones move either way
        assert rows[-1][loss] < rows[0][loss], f"{name}: LoRA did not lower {loss}"
    start = exported_weights(in_workdir / "runs" / "assets", STARTING_MODEL[name])
    end = exported_weights(out, export)
    assert end.keys() == start.keys()
    moved = {key for key, tensor in start.items() if not torch.equal(end[key], tensor)}
    adapted = {  # LoRA adapts a projection's weight; its bias (q/k/v) stays the base's
        key for key in start if key.endswith(".weight") and key.split(".")[-2] in DEFAULT_TARGETS
    }
    heads = {"score.weight"} if name == "reward_model" else set()
    assert adapted and moved == adapted | heads


@pytest.mark.usefixtures("ray_cluster")
def test_a_resumed_dpo_run_equals_an_uninterrupted_one(in_workdir: Path) -> None:
    """4 steps at once, and 2 steps + a resume to 4 (checkpoint of step 2): the same rows for
    steps 3-4 (loss, metrics) and the same final weights."""
    whole = in_workdir / "runs" / "dpo-whole"
    rows = _run("dpo", whole, "run.total_steps=4", "run.val_every=0", "run.export_final=true")
    part = in_workdir / "runs" / "dpo-part"
    _run("dpo", part, "run.total_steps=2", "run.val_every=0", "run.save_every=2")
    config = load_config(
        TrainerConfig,
        RECIPES / "dpo.yaml",
        [f"run.output_dir={part}", "run.total_steps=4", "run.val_every=0", "run.progress=false",
         "run.export_final=true"],
    )  # fmt: skip
    trainer = trainer_class(config)(config, resume=True)
    trainer.fit()
    assert trainer.start_steps == [2]
    resumed = [json.loads(line) for line in (part / "metrics.jsonl").open()]
    volatile = ("perf/", "memory/", "timestamp")
    for a, b in zip(rows, resumed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(volatile)} == {
            k: v for k, v in b.items() if not k.startswith(volatile)
        }
    final, resumed_final = exported_weights(whole), exported_weights(part)
    for key, tensor in final.items():
        assert torch.equal(resumed_final[key], tensor), key


def test_a_recipe_missing_its_trained_role_exits_2_naming_the_key(in_workdir: Path) -> None:
    """Before anything starts: a reward-model recipe without reward.model, a DPO recipe
    without a reference, bad preference and chat data."""
    import subprocess
    import sys

    def run(recipe: str, *overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hf_core.cli", "run", str(RECIPES / recipe), *overrides],
            capture_output=True,
            text=True,
            timeout=120,
        )

    missing = run("reward_model.yaml", "reward.model=null")
    assert missing.returncode == 2 and "reward.model" in missing.stderr, missing.stderr
    missing = run("dpo.yaml", "reference=null")
    assert missing.returncode == 2 and "reference" in missing.stderr, missing.stderr
    bad = in_workdir / "bad_pairs.jsonl"
    bad.write_text('{"prompt": "reverse 12:", "chosen": "21", "rejected": "12"}\n{"prompt": 3}\n')
    refused = in_workdir / "runs" / "refused_dpo"  # the shared workdir: a folder of its own
    broken = run("dpo.yaml", f"data.train_files=[{bad}]", f"run.output_dir={refused}")
    assert broken.returncode == 2, broken.stderr
    assert "bad_pairs.jsonl" in broken.stderr and "2" in broken.stderr, broken.stderr
    assert not refused.exists(), "a refused run left its folder behind"
    bad = in_workdir / "bad_chat.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}'
        '\n{"messages": [{"role": "narrator", "content": "hi"}]}\n'
    )
    refused = in_workdir / "runs" / "refused_sft"
    broken = run("sft.yaml", f"data.train_files=[{bad}]", f"run.output_dir={refused}")
    assert broken.returncode == 2, broken.stderr
    assert "bad_chat.jsonl" in broken.stderr and "narrator" in broken.stderr, broken.stderr
    assert not refused.exists(), "a refused run left its folder behind"


SHORT_PIPELINE = [
    # SFT steps cost milliseconds here: enough of them that the samples differ (pairs)
    "sft.run.total_steps=40",
    "sft.run.val_every=40",
    *(
        f"{stage}.run.{key}"
        for stage in ("reward_model", "rl", "dpo")
        for key in ("total_steps=2", "val_every=2")
    ),
    "rl.run.total_steps=4",  # 2 rounds of 2 steps, the reward model trained on in between
    "pipeline.rl_rounds=2",
    "pipeline.round_pair_prompts=32",
    "pipeline.round_reward_model_steps=2",
    "pipeline.demonstrations=640",
    "pipeline.pair_prompts=64",
    "pipeline.pair_val_prompts=32",
    "pipeline.rl_prompts=48",
    "pipeline.eval_prompts=16",
    "pipeline.required.reward_model_accuracy=0",
    "pipeline.required.rl_gain=-1",
    "pipeline.required.dpo_gain=-1",
]
"""Every stage of recipes/pipeline_demo.py for a few steps on small sets, no figure required:
the default session's short version of ``nox -s pipeline_demo``."""


@pytest.mark.usefixtures("ray_cluster")
def test_the_pipeline_demo_runs_every_stage(
    in_workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = load_script(RECIPES / "pipeline_demo.py")
    out = in_workdir / "runs" / "pipeline_short"
    assert demo.main([*SHORT_PIPELINE, f"pipeline.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    for figure in ("untrained", "sft", "pairs", "reward_model", "rl", "dpo"):
        assert f"pipeline: {figure}:" in printed, printed[-2000:]
    assert "every stage reached its figure" in printed
    # each stage's export is what the next one read
    assert (out / "sft" / "actor_hf").is_dir() and (out / "reward_model" / "reward_hf").is_dir()
    assert (out / "reward_model" / "round_1" / "reward_hf").is_dir()  # round 2 scored with it
    assert (out / "rl" / "round_2" / "actor_hf").is_dir()
    assert "round 2" in printed
    pairs = (out / "assets" / "pair_train.jsonl").read_text().splitlines()
    assert pairs and all({"prompt", "chosen", "rejected"} <= json.loads(p).keys() for p in pairs)
