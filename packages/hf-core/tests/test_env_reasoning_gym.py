"""The reasoning-gym environment: its prompts are the library's questions, its reward is the
library's own ``score_answer`` on every sample, seeds choose and reproduce the prompts, and a
missing library or an unknown task is a ConfigError naming what to do."""

from __future__ import annotations

from typing import Any

import pytest

from hf_core.config import ConfigError
from hf_core.environments import ENV_TASK_KEY, build_environment, task_metrics
from hf_core.environments.reasoning_gym import split_sizes
from hf_testing.missing_library import pretend_missing

reasoning_gym = pytest.importorskip("reasoning_gym")

TASKS = ["basic_arithmetic", "leg_counting", "spell_backward", "letter_counting"]


def _env(**settings: Any) -> Any:
    return build_environment({"kind": "reasoning_gym", "size": 12, "val_size": 4, **settings})


def _extras(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = [k for k in records[0] if k not in ("prompt", "ground_truth")]
    return {k: [r[k] for r in records] for k in keys}


def _responses(records: list[dict[str, Any]]) -> list[str]:
    """Per record: the right answer in tags, a wrong one, the right one without tags, the
    right one padded with spaces inside the tags and a reply that gives up."""
    out = []
    for r in records:
        answer = r["ground_truth"]
        out += [
            f"Thinking... <answer>{answer}</answer>",
            "<answer>definitely not it</answer>",
            answer,
            f"<answer>  {answer} </answer>",
            "no idea",
        ]
    return out


@pytest.mark.parametrize("task", TASKS)
def test_our_reward_is_the_library_score_on_every_sample(task: str) -> None:
    env = _env(task=task)
    for split, seed in (("train", 0), ("val", 12)):  # val_seed: seed + size
        records = env.records(split)
        library = reasoning_gym.create_dataset(task, seed=seed, size=len(records))
        repeated = [r for r in records for _ in range(5)]
        responses = _responses(records)
        ours = env.score(responses, [r["ground_truth"] for r in repeated], _extras(repeated))
        expected = []
        for i, response in enumerate(responses):
            entry = library[i // 5]
            answer = reasoning_gym.utils.extract_answer(response)
            expected.append(float(library.score_answer(answer, entry)))
        assert ours == expected
        assert 1.0 in ours and 0.0 in ours  # right and wrong answers both occur
        for i, record in enumerate(records):  # the prompt is the library's question
            assert record["prompt"][-1]["content"] == library[i]["question"]
            assert record["ground_truth"] == str(library[i]["answer"])
            assert record[ENV_TASK_KEY] == task


def test_whole_response_answers_and_bare_questions() -> None:
    env = _env(task="basic_arithmetic", answer="whole", system_prompt=None)
    records = env.records("train")
    assert all(isinstance(r["prompt"], str) for r in records)
    truths = [r["ground_truth"] for r in records]
    scores = env.score([f" {t} " for t in truths], truths, _extras(records))
    assert scores == [1.0] * len(records)
    scores = env.score([f"<answer>{t}</answer>" for t in truths], truths, _extras(records))
    assert 1.0 not in scores  # tags are part of a whole-response answer


def test_the_library_system_prompt_leads_a_chat_prompt() -> None:
    record = _env(task="basic_arithmetic").records("train")[0]
    system, user = record["prompt"]
    assert system == {"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["default"]}
    assert user["role"] == "user"
    custom = _env(task="basic_arithmetic", system_prompt="Answer tersely.").records("train")[0]
    assert custom["prompt"][0]["content"] == "Answer tersely."


def test_seeds_choose_the_prompts_and_reproduce_them() -> None:
    def prompts(**seeds: Any) -> list[str]:
        return [r["prompt"] for r in _env(task="basic_arithmetic", **seeds).records("train")]

    assert prompts(seed=0) == prompts(seed=0)
    assert prompts(seed=0) != prompts(seed=5)
    env = _env(task="basic_arithmetic", seed=3)
    train = {str(r["prompt"]) for r in env.records("train")}
    val = {str(r["prompt"]) for r in env.records("val")}
    assert len(val) == 4 and not val & train  # the library's seeds overlap: ours do not
    with pytest.raises(ConfigError, match="would repeat training items"):
        _env(task="basic_arithmetic", seed=3, val_seed=4)
    assert _env(task="basic_arithmetic", seed=3, val_seed=15).records("val")


def test_a_weighted_mix_splits_by_weight_and_scores_each_task_by_its_own_code() -> None:
    env = _env(tasks={"basic_arithmetic": 3, "leg_counting": 1}, size=20, val_size=8)
    records = env.records("train")
    tasks = [r[ENV_TASK_KEY] for r in records]
    assert tasks.count("basic_arithmetic") == 15 and tasks.count("leg_counting") == 5
    assert tasks != sorted(tasks)  # interleaved, not one block per task
    truths = [r["ground_truth"] for r in records]
    scores = env.score([f"<answer>{t}</answer>" for t in truths], truths, _extras(records))
    assert scores == [1.0] * len(records)
    metrics = task_metrics(tasks, [1.0 if t == "leg_counting" else 0.5 for t in tasks])
    assert metrics["env/leg_counting/success"] == 1.0
    assert metrics["env/basic_arithmetic/reward"] == 0.5
    assert metrics["env/basic_arithmetic/success"] == 0.0
    assert metrics["env/basic_arithmetic/count"] == 15


def test_split_sizes_add_up() -> None:
    assert split_sizes({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}
    assert sum(split_sizes({"a": 0.2, "b": 0.7}, 7).values()) == 7


def test_generator_settings_reach_the_library() -> None:
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    env = _env(task="basic_arithmetic", task_config={"basic_arithmetic": small})
    library = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=12, **small)
    questions = [r["prompt"][-1]["content"] for r in env.records("train")]
    assert questions == [library[i]["question"] for i in range(12)]
    assert all(library[i]["metadata"]["num_terms"] == 2 for i in range(12))
    default = [r["prompt"][-1]["content"] for r in _env(task="basic_arithmetic").records("train")]
    assert questions != default


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"task": "basic_arithmatic"}, "did you mean basic_arithmetic"),
        ({"tasks": {"leg_countin": 1}}, "did you mean leg_counting"),
        ({}, "give either 'task'"),
        ({"task": "leg_counting", "tasks": {"leg_counting": 1}}, "give either 'task'"),
        ({"tasks": {"leg_counting": 0}}, "weights must be > 0"),
        ({"task": "leg_counting", "colour": "red"}, "env.colour"),
        ({"task": "leg_counting", "task_config": {"chain_sum": {}}}, "env.task_config"),
        ({"task": "leg_counting", "task_config": {"leg_counting": {"min_animals": "x"}}},
         "env.task_config.leg_counting"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _env(**settings)


def test_an_unknown_kind_names_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"env\.kind.*reasoning_gym"):
        build_environment({"kind": "reasoning_gm", "task": "leg_counting"})


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_missing(monkeypatch, "reasoning_gym")
    with pytest.raises(ConfigError, match=r"pip install 'hf-core\[reasoning-gym\]'"):
        _env(task="leg_counting")
