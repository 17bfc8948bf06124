"""Checks of the hybrid engine's memory hand-over log (``RLTrainer.handover_log``).

Every recipe's backend pair must hand the devices over in the same order each step; the e2e
recipes and each backend's own end-to-end runs check their logs with :func:`check_handover_log`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_handover_log(log: Sequence[dict[str, Any]], trainers: Sequence[str]) -> None:
    """Assert every step of ``log`` hands the devices over in order.

    ``trainers`` are the offloadable training engines in the actor worker (``actor``, and
    ``reference`` when there is one).  Each step: a full cycle of every engine; training
    engines onloaded only once the rollout engine released its memory; the rollout engine
    resumed before the weight sync; every move reporting bytes (on the CPU: what it would
    move); the step ending ready to generate (training engines offloaded, rollout resident).
    """
    assert log, "no hand-over was logged"
    # the trainer keeps the last steps only: a log starting later starts from a step's end
    offloaded = dict.fromkeys(trainers, log[0]["step"] > 1)
    resident = True
    for entry in log:
        step, events = entry["step"], entry["events"]
        actions = [(e["engine"], e["action"]) for e in events]
        for engine in trainers:
            assert (engine, "offload") in actions and (engine, "onload") in actions, (step, actions)
        assert ("rollout", "release") in actions and ("rollout", "resume") in actions, (
            step,
            actions,
        )
        for event in events:
            engine, action = event["engine"], event["action"]
            assert event["bytes"] > 0, f"step {step}: {engine} {action} reported no bytes"
            if engine == "rollout":
                assert resident == (action == "release"), (step, actions)
                resident = action == "resume"
                continue
            assert offloaded[engine] == (action == "onload"), (step, actions)
            offloaded[engine] = action == "offload"
            if action == "onload":  # training runs only once the rollout engine let go
                assert not resident, (step, actions)
        assert resident and all(offloaded.values()), f"step {step} ends mid-hand-over"
