"""A multi-turn ``verifiers`` environment for the tests and docs, written with the library's
own classes (``Taskset``, ``Task``, ``@vf.reward``, an ``Env`` that plays the user): guess a
digit in up to three turns.

Its id is this module's name, ``hf_testing.verifiers_guess`` (verifiers finds an environment
as a module exporting its ``Taskset`` and ``Env`` in ``__all__``).  Task ``i`` hides digit
``i * 7 % 10``.  The policy answers; a reply without the digit gets "Wrong (higher|lower|no
digit). Guess again." and another turn, up to ``max_rounds``.  The rubric (``@vf.reward``)
gives 1.0 when the last reply holds the digit, 0.25 when it holds another digit, 0.0 with no
digit; a task's ``log_file`` (the taskset's setting) receives one JSON line per scored episode
(task index, reward, turns), so a test can compare the rubric's scores with the rewards the
run trained on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import verifiers.v1 as vf

__all__ = ["DigitGuessEnv", "DigitGuessTaskset"]

PROMPT = "Guess my digit (0-9)."


def _digit(text: str | None) -> int | None:
    found = re.search(r"\d", text or "")
    return None if found is None else int(found.group())


class DigitGuessData(vf.TaskData):  # type: ignore[misc]
    secret: int
    log_file: str | None = None


class DigitGuessTask(vf.Task[DigitGuessData]):  # type: ignore[misc]
    @vf.reward  # type: ignore[untyped-decorator]
    async def guessed(self, trace: Any) -> float:
        guess = _digit(trace.last_reply)
        score = 0.0 if guess is None else 1.0 if guess == self.data.secret else 0.25
        if self.data.log_file:
            row = {"task": self.data.idx, "reward": score, "turns": trace.num_turns}
            with Path(self.data.log_file).open("a") as out:
                out.write(json.dumps(row) + "\n")
        return score


class DigitGuessConfig(vf.TasksetConfig):  # type: ignore[misc]
    count: int = 64
    log_file: str | None = None


class DigitGuessTaskset(vf.Taskset[DigitGuessTask, DigitGuessConfig]):  # type: ignore[misc]
    def load(self) -> Any:
        for i in range(self.config.count):
            data = DigitGuessData(
                idx=i, id=f"guess-{i}", prompt=PROMPT, secret=i * 7 % 10,
                log_file=self.config.log_file,
            )  # fmt: skip
            yield DigitGuessTask(data, self.config.task)


class DigitGuessEnvConfig(vf.EnvConfig):  # type: ignore[misc]
    player: vf.AgentConfig = vf.AgentConfig()
    max_rounds: int = 3


class DigitGuessEnv(vf.Env[DigitGuessEnvConfig]):  # type: ignore[misc]
    async def run(self, task: Any, agents: Any) -> None:
        secret = task.data.secret
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            rounds = 1
            while not segment.terminated and rounds < self.config.max_rounds:
                guess = _digit(segment.last_reply)
                if guess == secret:
                    break
                hint = "no digit" if guess is None else "higher" if guess < secret else "lower"
                segment = await chat.turn(f"Wrong ({hint}). Guess again.")
                rounds += 1
