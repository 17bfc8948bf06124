"""What ``hybridflow backends`` prints for one plugin: where it came from and what it gave."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BackendInfo:
    """One plugin's row: its distribution and, per hook, the names it registered."""

    plugin: str
    distribution: str
    version: str
    entry_point: str
    training_engines: list[str] = field(default_factory=list)
    rollout_engines: list[str] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    advantage_estimators: list[str] = field(default_factory=list)
    policy_losses: list[str] = field(default_factory=list)
    kl_estimators: list[str] = field(default_factory=list)
    aggregation_modes: list[str] = field(default_factory=list)
    reward_functions: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    environments: list[str] = field(default_factory=list)
    env_kinds: list[str] = field(default_factory=list)
    error: str = ""
    """Why the plugin was skipped (it failed to import); empty when it loaded."""
    group: str = ""
    """The entry-point group it was found in (empty for hf-core's own and run-time plugins)."""

    @property
    def algorithms(self) -> list[str]:
        """Estimators, policy losses, KL estimators and aggregation modes, in that order."""
        return (
            self.advantage_estimators
            + self.policy_losses
            + self.kl_estimators
            + self.aggregation_modes
        )

    @property
    def rewards_and_agents(self) -> list[str]:
        """Reward functions, agent tools, agent environments and task environment kinds,
        in that order."""
        return self.reward_functions + self.tools + self.environments + self.env_kinds
