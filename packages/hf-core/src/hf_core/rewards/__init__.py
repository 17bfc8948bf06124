"""Rule-based rewards: a registry of batched reward functions and a batch scorer.

    reward = RuleReward("digits_reverse", tokenizer)     # or "my_pkg.rewards:score"
    scores = reward(batch)                               # float32 [B]

Reward function signature (see :mod:`hf_core.rewards.registry`)::

    fn(responses: list[str], ground_truths: list[Any], extras: dict[str, list]) -> list[float]

Built-ins (registered when this package is imported): ``digits_reverse`` and ``digits_sort``
(partial credit, exact rule in :mod:`hf_core.rewards.builtin`), ``exact_match`` and
``code_tests`` (the response's code against ground-truth tests in the sandbox,
:mod:`hf_core.rewards.code`); the math answer checks ``math_verify`` and ``gsm8k``
(:mod:`hf_core.rewards.math_answers`, needs ``hf-core[math]``); the format checks
``format_gsm8k``, ``format_boxed`` and ``format_think`` (:mod:`hf_core.rewards.format`).  A
generative judge (a model scoring responses through a prompt) is a role, not a function: see
:mod:`hf_core.roles.judge_worker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_package
from hf_core.rewards import builtin as _builtin  # noqa: F401  (registers the built-ins)
from hf_core.rewards import code as _code  # noqa: F401  (registers code_tests)
from hf_core.rewards import format as _format  # noqa: F401
from hf_core.rewards import math_answers as _math_answers  # noqa: F401
from hf_core.rewards.builtin import LENGTH_TOLERANCE as LENGTH_TOLERANCE
from hf_core.rewards.builtin import digit_partial_credit as digit_partial_credit
from hf_core.rewards.registry import BatchedRewardFn as BatchedRewardFn
from hf_core.rewards.registry import PerSampleRewardFn as PerSampleRewardFn
from hf_core.rewards.registry import RewardFunction as RewardFunction
from hf_core.rewards.registry import UnknownRewardFunctionError as UnknownRewardFunctionError
from hf_core.rewards.registry import get_reward_function as get_reward_function
from hf_core.rewards.registry import reward_function as reward_function
from hf_core.rewards.registry import reward_function_names as reward_function_names

# The scorer decodes batches (torch); naming and checking reward functions does not need it.
if TYPE_CHECKING:
    from hf_core.rewards.scorer import RewardFunctionError as RewardFunctionError
    from hf_core.rewards.scorer import RuleReward as RuleReward

# The re-exports above; the typed ones load on first use (hf_core.lazy_imports).
__all__, __getattr__, __dir__ = lazy_package(__name__)
