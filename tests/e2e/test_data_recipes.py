"""The dataset recipes end to end: ``hybridflow data prepare`` on fixture rows the test writes,
then recipes/gsm8k_grpo.yaml and recipes/math_grpo.yaml for 3 steps on a tiny Qwen2 instruct
model (with a chat template) -- and a malformed input file exits 2 naming the file and row.

A random model never answers right, and ``0 <= verified <= samples`` holds when every reward is
0 -- also when the reward gets no ground truth.  So the fixture problems share one answer, and a
supervised warm start teaches the policy to state it in the format the reward reads: most of its
samples must then be verified, which only a reward that sees the prepared ground truth gives."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LONG, RECIPES

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer
from hf_testing.tiny import build_tiny_model

# A chat template in the Qwen style, over the tiny tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


# The judge's outputs are generated and parsed for real; a pattern no output holds makes each
# sample's judge score exactly JUDGE_SCORE, so the test can see it reach the reward (parsing
# real scores is tested against the same engine in hf-fsdp's test_judge.py).
JUDGE_SCORE = 0.5
JUDGE_OVERRIDES = [
    "reward.judge.max_new_tokens=4",
    "reward.judge.score_pattern=NO-SCORE-HERE",
    f"reward.judge.unparsed_score={JUDGE_SCORE}",
]


ANSWER = 42
"""Every fixture problem's answer (one answer, so a short warm start can teach it)."""
WARM_START = {"gsm8k": "#### {}", "math": "{}"}
"""The warm start's target per format: the prepared ground truth as the reward reads it (a
plain number for math-verify: a ``\\boxed{}`` would not fit in ``rollout.max_new_tokens``)."""


def _gsm8k_rows(n: int, seed: int) -> list[dict]:
    rows = []
    for i in range(n):
        a = 3 + i * 3 + seed
        b = ANSWER - a
        rows.append(
            {
                "question": f"Ann has {a} apples and buys {b} more. How many apples has she?",
                "answer": f"She has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }
        )
    return rows


def _math_rows(n: int) -> list[dict]:
    return [
        {
            "problem": f"Compute $\\frac{{{2 * (i + 1)}}}{{{i + 1}}} + {ANSWER - 2}$.",
            "solution": f"It is $2 + {ANSWER - 2} = \\boxed{{{ANSWER}}}$.",
            "level": "Level 1",
            "type": "Prealgebra",
        }
        for i in range(n)
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _hybridflow(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "hf_core.cli", *args], capture_output=True, text=True, timeout=300
    )


def _add_warm_start_targets(path: Path, target: str) -> None:
    """Give each prepared record an ``sft_target``: its own ground truth in ``target``'s form."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    _write_jsonl(path, [{**row, "sft_target": target.format(row["ground_truth"])} for row in rows])


@pytest.fixture(scope="module")
def instruct_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 folder whose tokenizer has a chat template, like an instruct model's (and
    the characters of ``####``, so the policy can write a GSM8K answer)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("instruct") / "tiny-instruct"
    build_tiny_model(
        folder, family="qwen2", hidden_size=64, num_layers=2, vocab_size=256, tool_calls=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(
    ("name", "judge"),
    [pytest.param("gsm8k", False, marks=LONG), ("math", False), ("gsm8k", True)],
    ids=str,
)
def test_dataset_recipe_runs_three_steps(
    name: str, judge: bool, instruct_model: Path, tmp_path: Path
) -> None:
    """``judge``: a generative judge (the tiny model on the transformers engine, in its own role
    worker) adds its score to the verified-answer reward."""
    raw = tmp_path / "raw"
    raw.mkdir()
    if name == "gsm8k":
        inputs = [
            _write_jsonl(raw / "train.jsonl", _gsm8k_rows(12, 0)),
            _write_jsonl(raw / "test.jsonl", _gsm8k_rows(4, 1)),
        ]
    else:  # MATH's layout: one JSON file per problem under <split>/<subject>/
        inputs = []
        for split, rows in (("train", _math_rows(12)), ("test", _math_rows(4))):
            for i, row in enumerate(rows):
                path = raw / split / "prealgebra" / f"{i}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(row))
            inputs.append(raw / split)
    data = tmp_path / "data" / name
    done = _hybridflow(
        "data", "prepare", name, "--input", *map(str, inputs), "--output", str(data),
        "--tokenizer", str(instruct_model),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [len((data / f).read_text().splitlines()) for f in ("train.jsonl", "test.jsonl")] == [
        12,
        4,
    ]
    assert "<|bos|>assistant" in (data / "preview.txt").read_text()  # the chat template
    _add_warm_start_targets(data / "train.jsonl", WARM_START[name])

    out = tmp_path / "run"
    config = load_config(
        TrainerConfig,
        RECIPES / f"{name}_grpo.yaml",
        [
            f"model.path={instruct_model}",
            f"data.train_files=[{data / 'train.jsonl'}]",
            f"data.val_files=[{data / 'test.jsonl'}]",
            f"run.output_dir={out}",
            "run.total_steps=3",
            "run.val_every=3",
            "run.progress=false",
            "data.batch_size=4",
            "data.val_batch_size=4",
            "rollout.n=2",
            "rollout.max_new_tokens=8",
            "algorithm.mini_batches=1",
            "actor.engine.lr=1e-3",
            "sft.steps=40",
            "sft.batch_size=8",
            "sft.target_key=sft_target",
            *([*JUDGE_OVERRIDES, f"reward.judge.model_path={instruct_model}"] if judge else []),
        ],
    )
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    base = JUDGE_SCORE if judge else 0.0  # the judge adds exactly JUDGE_SCORE to each sample
    samples = 4 * 2
    verified = [(row["reward/mean"] - base) * samples for row in rows]  # right answers
    for row, count in zip(rows, verified, strict=True):
        assert 0 <= count <= samples and count == pytest.approx(round(count))
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/kl"])
    # the warm-started policy states the answer: a reward blind to the ground truth scores 0
    assert sum(verified) >= len(rows) * samples / 2, verified
    assert base + 0.5 <= rows[-1]["val/reward_mean"] <= base + 1.0
    assert (out / "checkpoints" / "latest").read_text() == "step_3"


def test_malformed_input_exits_2_naming_file_and_row(tmp_path: Path) -> None:
    good = _gsm8k_rows(3, 0)
    bad = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in good] + ['{"question": "How many?", "solution": "#### 4"}']
    bad.write_text("\n".join(lines) + "\n")
    done = _hybridflow(
        "data", "prepare", "gsm8k", "--input", str(bad), "--output", str(tmp_path / "out")
    )
    assert done.returncode == 2
    message = " ".join(done.stderr.split())
    assert f"{bad}: row 3 (line 4): no 'answer' field" in message
    assert not (tmp_path / "out").exists()  # nothing written
