"""An OpenAI-compatible endpoint in front of a rollout engine, token-in-token-out.

Agent code written against a chat API (the ``openai`` client) runs unchanged against the
policy during rollouts, and every trajectory is kept as the exact token ids that were sampled
(:mod:`hf_core.serving.trajectories`).  docs/agents.md describes the contract.
"""

from hf_core.lazy_imports import reexports
from hf_core.serving.batching import Completion as Completion
from hf_core.serving.batching import EngineBatcher as EngineBatcher
from hf_core.serving.endpoint import EndpointLimits as EndpointLimits
from hf_core.serving.endpoint import ForeignTrajectory as ForeignTrajectory
from hf_core.serving.endpoint import PolicyEndpoint as PolicyEndpoint
from hf_core.serving.endpoint import TooManyTrajectories as TooManyTrajectories
from hf_core.serving.endpoint import TrajectoryClosed as TrajectoryClosed
from hf_core.serving.endpoint import TrajectoryTicket as TrajectoryTicket
from hf_core.serving.endpoint import UnknownTrajectory as UnknownTrajectory
from hf_core.serving.server import EndpointServer as EndpointServer
from hf_core.serving.trajectories import ChatRenderer as ChatRenderer
from hf_core.serving.trajectories import ConversationEdited as ConversationEdited
from hf_core.serving.trajectories import InvalidPrompt as InvalidPrompt
from hf_core.serving.trajectories import PromptTooLong as PromptTooLong
from hf_core.serving.trajectories import Trajectory as Trajectory
from hf_core.serving.trajectories import TrajectoryLimit as TrajectoryLimit

__all__ = sorted(reexports(__name__))
