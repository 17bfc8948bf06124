"""hf_core.rewards: registry, import paths, partial credit, batch scoring and its errors."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from hf_core.batch import Batch
from hf_core.rewards import (
    RewardFunctionError,
    RuleReward,
    UnknownRewardFunctionError,
    digit_partial_credit,
    get_reward_function,
    reward_function,
    reward_function_names,
)
from hf_core.rewards import registry as registry_module


@pytest.fixture(autouse=True)
def private_registry(monkeypatch):
    """Registrations made by a test vanish after it (the built-ins stay visible)."""
    monkeypatch.setattr(
        registry_module, "REWARD_FUNCTIONS", registry_module.REWARD_FUNCTIONS.copy()
    )


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["reverse 12345: 54321", "sort 3141: 1134"] * 20,
        BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


# ------------------------------------------------------------------------ partial credit


@pytest.mark.parametrize(
    ("response", "target", "score"),
    [
        ("54321", "54321", 1.0),
        (" 54321 \n", "54321", 1.0),  # surrounding whitespace is ignored
        ("54320", "54321", 4 / 5),
        ("12345", "54321", 1 / 5),  # only the middle digit is in place
        ("543", "54321", 3 / 5),  # too short: the missing positions count as wrong
        ("543210", "54321", 5 / 6),  # one extra character, within the tolerance
        ("5432100", "54321", 5 / 7),  # two extra: still within the tolerance
        ("54321000", "54321", 0.0),  # three extra: runaway output scores 0
        ("5a3b1", "54321", 3 / 5),  # non-digits never match
        ("abcde", "54321", 0.0),
        ("", "54321", 0.0),
        ("007", "007", 1.0),  # leading zeros are significant
        ("7", "007", 0.0),
    ],
)
def test_digit_partial_credit(response, target, score):
    assert digit_partial_credit(response, target) == pytest.approx(score)


def test_builtin_batched_functions():
    reverse = get_reward_function("digits_reverse")
    assert list(reverse(["321", "3x1", "9"], ["321", "321", "321"], {})) == pytest.approx(
        [1.0, 2 / 3, 0.0]
    )
    assert get_reward_function("digits_sort")(["0012"], ["0012"], {}) == [1.0]
    exact = get_reward_function("exact_match")
    assert exact([" 42\n", "42", "7", "x"], ["42", "43", ["6", "7"], None], {}) == [
        1.0,
        0.0,
        1.0,
        0.0,
    ]
    assert {"digits_reverse", "digits_sort", "exact_match"} <= set(reward_function_names())


# ------------------------------------------------------------------------------ registry


def test_registry_decorators_and_errors():
    @reward_function("length_bonus")
    def length_bonus(responses, ground_truths, extras):
        return [len(r) / 10 for r in responses]

    @reward_function("prefix_match", batched=False)
    def prefix_match(response, ground_truth, extra):
        return float(response.startswith(str(ground_truth))) + extra["bonus"]

    assert get_reward_function("length_bonus")(["abc"], [None], {}) == [pytest.approx(0.3)]
    # The decorator returns the per-sample function unchanged, the registry holds a batch adapter.
    assert prefix_match("12", "1", {"bonus": 0.0}) == 1.0
    fn = get_reward_function("prefix_match")
    assert fn(["12", "21"], ["1", "1"], {"bonus": [0.0, 0.5]}) == [1.0, 0.5]

    with pytest.raises(ValueError, match="'length_bonus' is already registered"):

        @reward_function("length_bonus")
        def other(responses, ground_truths, extras):
            return [0.0] * len(responses)

    with pytest.raises(UnknownRewardFunctionError, match="did you mean 'digits_reverse'"):
        get_reward_function("digit_reverse")


def test_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            from hf_core.rewards import reward_function

            def batched(responses, ground_truths, extras):
                return [float(r == g) for r, g in zip(responses, ground_truths)]

            @reward_function("my_per_sample", batched=False)
            def per_sample(response, ground_truth, extra):
                return 0.25
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_function("my_rewards:batched")
    assert fn.name == "my_rewards:batched"
    assert fn(["a", "b"], ["a", "a"], {}) == [1.0, 0.0]
    # A per-sample function reached by path keeps its batch adapter.
    assert get_reward_function("my_rewards:per_sample")(["x", "y"], [1, 2], {}) == [0.25, 0.25]
    with pytest.raises(UnknownRewardFunctionError, match="cannot import module 'no_such_mod'"):
        get_reward_function("no_such_mod:fn")
    with pytest.raises(UnknownRewardFunctionError, match="has no attribute 'missing'"):
        get_reward_function("my_rewards:missing")


def test_import_path_errors_name_the_path(tmp_path, monkeypatch):
    """A module that raises while imported, a missing module, a non-callable: each one
    :class:`UnknownRewardFunctionError` naming the path (the run's preflight reports it)."""
    (tmp_path / "raising_rewards.py").write_text("raise RuntimeError('needs an API key')\n")
    (tmp_path / "syntax_rewards.py").write_text("def score(:\n")
    (tmp_path / "value_rewards.py").write_text("SCALE = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownRewardFunctionError, match="raised RuntimeError: needs an API key"):
        get_reward_function("raising_rewards:score")
    with pytest.raises(
        UnknownRewardFunctionError, match=r"SyntaxError.*syntax_rewards\.py, line 1"
    ):
        get_reward_function("syntax_rewards:score")
    with pytest.raises(UnknownRewardFunctionError, match="is a float, not a callable"):
        get_reward_function("value_rewards:SCALE")
    with pytest.raises(UnknownRewardFunctionError, match="is its folder on PYTHONPATH"):
        get_reward_function("no_such_mod:fn")


# ------------------------------------------------------------------------ batch scoring


def _response_batch(tokenizer, texts, garbage="999"):
    """Right-padded responses whose masked tail holds digits, so masking is checked."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    tail = tokenizer(garbage, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    width = max(len(r) for r in rows) + 1 + len(tail)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        real = [*row, eos]  # an EOS inside the mask: decoded with special tokens skipped
        ids[i, : len(real)] = torch.tensor(real)
        ids[i, len(real) : len(real) + len(tail)] = torch.tensor(tail)
        mask[i, : len(real)] = 1
    return ids, mask


def test_rule_reward_scores_a_batch(tokenizer):
    texts = [" 54321", "54320", "abc", "54321000"]
    ids, mask = _response_batch(tokenizer, texts)
    batch = Batch(
        {"responses": ids, "response_mask": mask},
        {"ground_truth": ["54321"] * 4, "raw_prompt": ["reverse 12345:"] * 4},
    )
    reward = RuleReward("digits_reverse", tokenizer)
    assert reward.decode(batch) == texts
    scores = reward(batch)
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert scores.tolist() == pytest.approx([1.0, 0.8, 0.0, 0.0])

    seen = {}

    def spy(responses, ground_truths, extras):
        seen.update(extras)
        return [0.5] * len(responses)

    RuleReward(spy, tokenizer)(batch)
    assert list(seen) == ["raw_prompt"] and seen["raw_prompt"] == ["reverse 12345:"] * 4


def test_a_raising_function_names_the_sample(tokenizer):
    def fragile(responses, ground_truths, extras):
        return [1.0 / int(r) for r in responses]

    ids, mask = _response_batch(tokenizer, ["4", "2", "0", "5"])
    batch = Batch({"responses": ids, "response_mask": mask}, {"ground_truth": ["a", "b", "c", "d"]})
    with pytest.raises(RewardFunctionError) as info:
        RuleReward(fragile, tokenizer)(batch)
    message = str(info.value)
    assert "'test_a_raising_function_names_the_sample.<locals>.fragile'" in message
    assert "sample 2 of 4" in message
    assert "response='0'" in message and "ground_truth='c'" in message
    assert "ZeroDivisionError" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_a_batch_only_failure_is_reported():
    def needs_pairs(responses, ground_truths, extras):
        if len(responses) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="on the batch of 2 but on no single sample"):
        RuleReward(needs_pairs).score_texts(["a", "b"], [None, None])


@pytest.mark.parametrize(
    ("output", "match"),
    [
        ([1.0], r"returned 1 scores for 2 responses"),
        ([1.0, math.nan], r"nan, not a finite number for sample 1 \(response='b'"),
        ([1.0, math.inf], r"inf, not a finite number for sample 1"),
        ([1.0, "high"], r"a str \('high'\), not a number for sample 1"),
        ([None, 1.0], r"a NoneType \(None\), not a number for sample 0"),
        (0.5, r"must return a list of floats, got float"),
    ],
)
def test_output_validation(output, match):
    with pytest.raises(RewardFunctionError, match=match):
        RuleReward(lambda r, g, e: output).score_texts(["a", "b"], ["x", "y"])


def test_numpy_and_tensor_outputs_are_accepted():
    import numpy as np

    assert RuleReward(lambda r, g, e: np.array([1, 0])).score_texts(["a", "b"]).tolist() == [
        1.0,
        0.0,
    ]
    assert RuleReward(lambda r, g, e: torch.tensor([0.25, True])).score_texts(
        ["a", "b"]
    ).tolist() == [0.25, 1.0]
