"""The math, format and judge-parsing rewards on responses written by the tests: equivalent
answers (0.5, 1/2, \\frac{1}{2}) get credit, wrong ones do not."""

from __future__ import annotations

import threading

import pytest

from hf_core.config import TrainerConfig
from hf_core.rewards import get_reward_function
from hf_core.rewards.judge import DEFAULT_TEMPLATE, GenerativeJudge, prompt_text

pytest.importorskip("math_verify")

HALF = ["0.5", "1/2", "\\frac{1}{2}", "\\frac12", ".5"]


def _score(name: str, responses: list[str], truths: list) -> list[float]:
    fn = get_reward_function(name)
    return list(fn(responses, truths, {}))


@pytest.mark.parametrize("truth", ["0.5", "1/2", "\\frac{1}{2}"])
def test_equivalent_answers_get_credit(truth: str) -> None:
    responses = [
        "So the probability is $0.5$.",
        "Therefore the answer is $\\boxed{1/2}$.",
        "We get \\boxed{\\frac{1}{2}}",
        "Half: $\\frac12$",
    ]
    assert _score("math_verify", responses, [truth] * len(responses)) == [1.0] * len(responses)


@pytest.mark.parametrize("truth", HALF)
def test_wrong_answers_get_none(truth: str) -> None:
    responses = [
        "The answer is $\\boxed{0.6}$.",
        "\\boxed{\\frac{1}{3}}",
        "It is $2$.",
        "I don't know.",
        "",
    ]
    assert _score("math_verify", responses, [truth] * len(responses)) == [0.0] * len(responses)


def test_math_verify_symbolic_and_lists() -> None:
    responses = ["$\\boxed{2\\sqrt{2}}$", "$\\boxed{\\sqrt{8}}$", "\\boxed{3}", "\\boxed{x+1}"]
    truths = ["\\sqrt{8}", "2\\sqrt{2}", ["4", "3"], "1+x"]
    assert _score("math_verify", responses, truths) == [1.0, 1.0, 1.0, 1.0]
    assert _score("math_verify", ["\\boxed{3}"], [None]) == [0.0]


def test_gsm8k_reward_reads_after_the_mark() -> None:
    responses = [
        "48/2 = 24, 48 + 24 = 72.\n#### 72",
        "#### 1,234",
        "#### 72.0",
        "72",  # right number, no mark: the prompt asked for '####'
        "#### 71",
        "#### ",
    ]
    truths = ["72", "1234", "72", "72", "72", "72"]
    assert _score("gsm8k", responses, truths) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert _score("gsm8k", ["#### 0.5", "#### 1/2"], ["\\frac{1}{2}", "0.5"]) == [1.0, 1.0]


def test_math_rewards_work_off_the_main_thread() -> None:
    """The library's SIGALRM timeouts exist only on the main thread; elsewhere they are off."""
    out: list[list[float]] = []
    thread = threading.Thread(
        target=lambda: out.append(_score("math_verify", ["\\boxed{1/2}", "\\boxed{2}"], HALF[:2]))
    )
    thread.start()
    thread.join()
    assert out == [[1.0, 0.0]]


def test_format_rewards() -> None:
    assert _score("format_gsm8k", ["so #### 72", "#### -1,234.5", "72", "#### x"], [None] * 4) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert _score("format_boxed", ["\\boxed{1}", "\\boxed{}", "\\boxed{1", "1"], [None] * 4) == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    think = ["<think>a</think> 5", "<think></think>5", "<think>a</think>", "5"]
    assert _score("format_think", think, [None] * 4) == [1.0, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------- hedging the answer
# A response that lists candidate answers must not get credit for the one that is right.

HEDGES = {
    "several_boxed": "\\boxed{1} \\boxed{2} \\boxed{3} \\boxed{-2} \\boxed{50}",
    "a_list_in_a_box": "\\boxed{1, 2, 3, -2, 50}",
    "or_in_a_box": "\\boxed{1 \\text{ or } 2 \\text{ or } 3}",
    "a_set": "\\boxed{\\{1, 2, 3, -2, 50\\}}",
    "solutions_listed": "$x = 1$, $x = 2$, $x = 3$, $x = -2$, $x = 50$",
    "plus_minus": "\\boxed{\\pm 2}",
    "an_interval": "\\boxed{(-100, 100)}",
    "an_inequality": "\\boxed{x > -100}",
    "all_reals": "\\boxed{\\mathbb{R}}",
}


@pytest.mark.parametrize("response", list(HEDGES.values()), ids=list(HEDGES))
def test_a_hedge_gets_no_credit(response: str) -> None:
    truths = ["1", "2", "3", "-2", "50"]
    assert _score("math_verify", [response] * len(truths), truths) == [0.0] * len(truths)


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{x = 1 = 2 = 3}",
        "\\boxed{3 \\text{ (or maybe } 2 \\text{ or } 1)}",
        "\\boxed{\\begin{cases} 1 \\\\ 2 \\\\ 3 \\end{cases}}",
        "It is 1 or 2 or 3.",
        "1 2 3",
        "$1$ $2$ $3$",
    ],
)
def test_a_list_that_is_not_a_set_counts_as_one_answer(response: str) -> None:
    assert sum(_score("math_verify", [response] * 3, ["1", "2", "3"])) <= 1.0


@pytest.mark.parametrize(
    "response", ["#### 71 72 73", "#### 71, 72, 73", "#### 71 or 72 or 73", "#### 71\n#### 72"]
)
def test_gsm8k_reads_one_answer_after_the_mark(response: str) -> None:
    assert sum(_score("gsm8k", [response] * 3, ["71", "72", "73"])) <= 1.0
    assert _score("gsm8k", ["#### 72 \\pm 1", "#### 70 \\le x \\le 80"], ["72", "72"]) == [0, 0]


def test_a_response_matching_every_pattern_is_not_correct() -> None:
    """Think block, several boxed answers and a '####': the format it hedges fails, and no
    candidate is the answer."""
    response = "<think>1, 2 or 3?</think>\n\\boxed{1} \\boxed{2} \\boxed{3}\n#### 1 2 3"
    assert _score("math_verify", [response] * 3, ["1", "2", "3"]) == [0.0] * 3
    assert _score("format_boxed", [response], [None]) == [0.0]


def test_format_boxed_wants_one_answer() -> None:
    responses = ["\\boxed{1} or \\boxed{2}", "\\fbox{1} \\boxed{2}", "\\boxed{1}", "so \\fbox{1}"]
    assert _score("format_boxed", responses, [None] * 4) == [0.0, 0.0, 1.0, 1.0]


def test_format_think_wants_one_block() -> None:
    responses = [
        "<think>a</think>b</think>c",  # two candidate answers: "b" or "c"?
        "<think>a<think>b</think>c",
        "<think>a</think>b<think>c</think>d",
        "<think>a</think> b",
    ]
    assert _score("format_think", responses, [None] * 4) == [0.0, 0.0, 0.0, 1.0]


def test_judge_prompt_and_score_parsing() -> None:
    judge = GenerativeJudge(engine=None, tokenizer=None)  # type: ignore[arg-type]
    text = judge.judge_prompt(
        [{"role": "user", "content": "What is {x}?"}], "It is \\boxed{2}", "\\frac{4}{2}"
    )
    assert text == (
        DEFAULT_TEMPLATE.replace("{prompt}", "user: What is {x}?")
        .replace("{response}", "It is \\boxed{2}")
        .replace("{ground_truth}", "\\frac{4}{2}")
    )
    assert [judge.parse_score(t) for t in [" 7", "10/10", "score: 12", "-3", "none"]] == [
        0.7,
        1.0,
        1.0,
        0.0,
        None,
    ]
    assert prompt_text("plain") == "plain" and prompt_text(None) == ""
    with pytest.raises(ValueError, match="\\{response\\}"):
        GenerativeJudge(engine=None, tokenizer=None, template="no slot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="score_pattern"):
        GenerativeJudge(engine=None, tokenizer=None, score_pattern="(")  # type: ignore[arg-type]


def test_judge_config_is_checked() -> None:
    base = {"model": {"path": "/m"}}
    config = TrainerConfig.model_validate({**base, "reward": {"judge": {"model_path": "/j"}}})
    assert config.reward.judge is not None and config.reward.judge.backend == "transformers"
    with pytest.raises(ValueError, match="not both"):
        TrainerConfig.model_validate(
            {**base, "reward": {"judge": {"model_path": "/j"}, "model": {"backend": "fsdp"}}}
        )
    with pytest.raises(ValueError, match="auto"):
        TrainerConfig.model_validate(
            {**base, "reward": {"judge": {"model_path": "/j"}}, "placement": {"mode": "auto"}}
        )
