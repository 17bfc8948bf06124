"""The code_tests reward runs responses' code against ground-truth tests in the sandbox."""

from __future__ import annotations

import time

import pytest

from hf_core.rewards import code as code_reward
from hf_core.rewards import get_reward_function
from hf_core.rewards.code import extract_code


def test_extracts_the_last_fenced_block() -> None:
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```\ndef f():\n    return 2\n```\n"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def g(): return 3") == "def g(): return 3"


def test_scores_the_fraction_of_tests_passed() -> None:
    fn = get_reward_function("code_tests")
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "def add(a, b):\n    return a - b"
    tests = ["assert add(2, 3) == 5", "assert add(0, 0) == 0"]
    scores = fn([good, wrong, "syntax error (", good], [tests, tests, tests, None], {})
    assert list(scores) == [1.0, 0.5, 0.0, 0.0]


def test_a_hanging_or_greedy_solution_fails_and_the_batch_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = code_reward.CODE_TEST_LIMITS.model_copy(
        update={"wall_seconds": 1.5, "cpu_seconds": 1, "memory_mb": 256}
    )
    monkeypatch.setattr(code_reward, "CODE_TEST_LIMITS", limits)
    hang = "def f():\n    while True:\n        pass"
    greedy = "def f():\n    return bytearray(2**40)"
    sleepy = "import time\ndef f():\n    time.sleep(60)"
    good = "def f():\n    return 1"
    start = time.monotonic()
    scores = code_reward.code_tests([hang, greedy, sleepy, good], ["assert f() == 1"] * 4, {})
    assert list(scores) == [0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < 6
