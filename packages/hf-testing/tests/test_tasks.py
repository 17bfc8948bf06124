"""The digit task: deterministic records, and a file the loader and the digit rewards take."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_core.data import PromptDataset, PromptLoader
from hf_core.rewards import RuleReward
from hf_testing.tasks import make_digit_task, write_digit_task
from hf_testing.tiny import build_tokenizer


def test_make_digit_task() -> None:
    records = make_digit_task("reverse", n=50, min_len=2, max_len=4, seed=1)
    assert records == make_digit_task("reverse", n=50, min_len=2, max_len=4, seed=1)
    assert records != make_digit_task("reverse", n=50, min_len=2, max_len=4, seed=2)
    lengths = set()
    for record in records:
        assert set(record) == {"prompt", "ground_truth"}
        kind, digits = record["prompt"].rstrip(":").split(" ")
        assert kind == "reverse" and digits.isdigit()
        assert record["ground_truth"] == digits[::-1]
        lengths.add(len(digits))
    assert lengths == {2, 3, 4}
    for record in make_digit_task("sort", n=20, min_len=5, max_len=5, seed=0):
        digits = record["prompt"][len("sort ") : -1]
        assert record["ground_truth"] == "".join(sorted(digits)) and len(digits) == 5
    with pytest.raises(ValueError, match="kind must be"):
        make_digit_task("add", n=1)  # type: ignore[arg-type]


def test_digit_task_file_feeds_the_loader_and_the_reward(tmp_path: Path) -> None:
    path = write_digit_task(tmp_path / "task.jsonl", "sort", n=6, seed=0)
    loader = PromptLoader(PromptDataset.from_files(path, build_tokenizer()), 3, shuffle=False)
    batch = next(loader)
    answers = list(batch["ground_truth"])
    scores = RuleReward("digits_sort").score_texts(answers, answers, {})
    assert scores.tolist() == [1.0, 1.0, 1.0]
