"""RLHF dataflows as the planner sees them: which model does what in which stage (§2.1, Fig. 1).

An iteration runs three stages in order -- generation, preparation, training -- and each stage
is a list of operations ``(role, kind)``.  Stage boundaries are where the score synchronises
(§6: sum inside a colocated set, max across sets, sum over stages).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

OpKind = Literal["generate", "infer", "train"]
STAGES: tuple[str, ...] = ("generation", "preparation", "training")
VALUE_HEAD_ROLES: frozenset[str] = frozenset({"critic", "reward", "cost"})
"""Roles whose model ends in a scalar head rather than the vocabulary."""


@dataclass(frozen=True)
class Op:
    """One operation of one role: generate rollouts, a forward pass, or a training update.

    ``extra_per_prompt`` adds sequences beyond ``samples_per_prompt`` (ReMax's greedy baseline
    rollout, which the reward model also scores).
    """

    role: str
    kind: OpKind
    extra_per_prompt: int = 0


@dataclass(frozen=True)
class Dataflow:
    """An algorithm's models and the operations of each stage."""

    name: str
    stages: tuple[tuple[str, tuple[Op, ...]], ...]

    def __post_init__(self) -> None:
        """One generating role at most: the planner models one hybrid actor engine."""
        generators = {op.role for op in self.ops() if op.kind == "generate"}
        if len(generators) > 1:
            raise ValueError(
                f"dataflow {self.name!r}: one generating role expected, got {generators}"
            )

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles in first-use order (the order plans list them in)."""
        seen: dict[str, None] = {}
        for op in self.ops():
            seen.setdefault(op.role, None)
        return tuple(seen)

    def ops(self, role: str | None = None) -> list[Op]:
        """All operations, or those of one role."""
        return [op for _, ops in self.stages for op in ops if role is None or op.role == role]

    def stage_ops(self, role: str) -> list[tuple[str, Op]]:
        """``(stage, op)`` pairs of one role."""
        return [(stage, op) for stage, ops in self.stages for op in ops if op.role == role]

    @property
    def generator(self) -> str | None:
        """The role that generates rollouts (the actor), if any."""
        return next((op.role for op in self.ops() if op.kind == "generate"), None)

    def trains(self, role: str) -> bool:
        """Whether the role is updated, so it carries gradients and optimizer states."""
        return any(op.kind == "train" for op in self.ops(role))

    def stage_names(self) -> tuple[str, ...]:
        """Stage names in execution order."""
        return tuple(stage for stage, _ in self.stages)


def _flow(name: str, gen: Iterable[Op], prep: Iterable[Op], train: Iterable[Op]) -> Dataflow:
    """Assemble the three standard stages."""
    return Dataflow(
        name, (("generation", tuple(gen)), ("preparation", tuple(prep)), ("training", tuple(train)))
    )


PPO = _flow(
    "ppo",
    [Op("actor", "generate")],
    [Op("actor", "infer"), Op("reference", "infer"), Op("critic", "infer"), Op("reward", "infer")],
    [Op("actor", "train"), Op("critic", "train")],
)
"""PPO (Fig. 1a): the actor's old log-probs, reference log-probs, values and rewards."""

GRPO = _flow(
    "grpo",
    [Op("actor", "generate")],
    [Op("actor", "infer"), Op("reference", "infer"), Op("reward", "infer")],
    [Op("actor", "train")],
)
"""GRPO: no critic; group statistics of ``samples_per_prompt`` rollouts replace values."""

REMAX = _flow(
    "remax",
    [Op("actor", "generate", extra_per_prompt=1)],
    [Op("actor", "infer"), Op("reference", "infer"), Op("reward", "infer", extra_per_prompt=1)],
    [Op("actor", "train")],
)
"""ReMax (Fig. 1b): one extra greedy rollout per prompt, scored as the baseline."""

SAFE_RLHF = _flow(
    "safe-rlhf",
    [Op("actor", "generate")],
    [
        Op("actor", "infer"),
        Op("reference", "infer"),
        Op("critic", "infer"),
        Op("reward", "infer"),
        Op("cost", "infer"),
    ],
    [Op("actor", "train"), Op("critic", "train")],
)
"""Safe-RLHF (Fig. 1c): PPO plus a cost model whose scores enter a Lagrangian."""

DATAFLOWS: dict[str, Dataflow] = {d.name: d for d in (PPO, GRPO, REMAX, SAFE_RLHF)}


def get_dataflow(name: str | Dataflow) -> Dataflow:
    """A preset by name (``ppo``, ``grpo``, ``remax``, ``safe-rlhf``), or the dataflow itself."""
    if isinstance(name, Dataflow):
        return name
    key = name.strip().lower().replace("_", "-")
    key = {"saferlhf": "safe-rlhf", "safe": "safe-rlhf"}.get(key, key)
    if key not in DATAFLOWS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {sorted(DATAFLOWS)}")
    return DATAFLOWS[key]
