"""An OpenAI-compatible endpoint in front of a rollout engine, token-in-token-out.

Agent code written against a chat API (the ``openai`` client) runs unchanged against the
policy during rollouts, and every trajectory is kept as the exact token ids that were sampled
(:mod:`hf_core.serving.trajectories`).  docs/agents.md describes the contract.
"""

from hf_core.serving.batching import Completion, EngineBatcher
from hf_core.serving.endpoint import (
    EndpointLimits,
    ForeignTrajectory,
    PolicyEndpoint,
    TooManyTrajectories,
    TrajectoryClosed,
    TrajectoryTicket,
    UnknownTrajectory,
)
from hf_core.serving.server import EndpointServer
from hf_core.serving.trajectories import (
    ChatRenderer,
    ConversationEdited,
    InvalidPrompt,
    PromptTooLong,
    Trajectory,
    TrajectoryLimit,
)

__all__ = [
    "ChatRenderer",
    "Completion",
    "ConversationEdited",
    "EndpointLimits",
    "EndpointServer",
    "EngineBatcher",
    "ForeignTrajectory",
    "InvalidPrompt",
    "PolicyEndpoint",
    "PromptTooLong",
    "TooManyTrajectories",
    "Trajectory",
    "TrajectoryClosed",
    "TrajectoryLimit",
    "TrajectoryTicket",
    "UnknownTrajectory",
]
