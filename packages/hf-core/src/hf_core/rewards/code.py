"""``code_tests``: run a response's Python against ground-truth tests in the sandbox.

The code is the last fenced block of the response (```` ```python ... ``` ```` or a bare
```` ``` ```` fence), or the whole response when it has none.  The ground truth is test code
(a string, e.g. ``assert add(2, 3) == 5``) or a list of such tests; each test runs in its own
sandboxed process after the code (:func:`hf_core.agents.sandbox.run_python`), and the reward is
the fraction of tests that exit cleanly.  A test that hangs, burns CPU or memory is killed at
the sandbox's limits and counts as failed; the batch's tests run in parallel threads.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hf_core.agents.sandbox import SandboxLimits, run_python
from hf_core.rewards.registry import reward_function

CODE_TEST_LIMITS = SandboxLimits(cpu_seconds=5, memory_mb=512, wall_seconds=10.0)
"""The limits each test runs under."""

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or the whole response without one."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _tests(ground_truth: Any) -> list[str]:
    if ground_truth is None:
        return []
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(t) for t in ground_truth]


@reward_function("code_tests")
def code_tests(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """Fraction of each sample's tests its code passes (0.0 for a sample with no tests)."""
    jobs = [
        (i, extract_code(response) + "\n\n" + test)
        for i, (response, truth) in enumerate(zip(responses, ground_truths, strict=True))
        for test in _tests(truth)
    ]
    passed = [0] * len(responses)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = pool.map(lambda job: run_python(job[1], CODE_TEST_LIMITS).ok, jobs)
        for (i, _), ok in zip(jobs, results, strict=True):
            passed[i] += int(ok)
    return [
        passed[i] / len(_tests(truth)) if _tests(truth) else 0.0
        for i, truth in enumerate(ground_truths)
    ]
