"""The ``hybridflow plan`` recipe: a small YAML schema (algorithm, models, workload, cluster).

Loaded through OmegaConf so dotted command-line overrides (``workload.global_batch=512``)
merge like everywhere else, then validated by pydantic so a bad value is named by its key.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hf_core.planner.dataflow import Dataflow, get_dataflow
from hf_core.planner.devices import DeviceCluster, make_cluster
from hf_core.planner.models import ModelSpec, load_model
from hf_core.planner.workload import Workload


class ClusterSpec(BaseModel):
    """Cluster section: shape, device preset, field overrides and a measured profile."""

    model_config = ConfigDict(extra="forbid")

    nodes: int | None = Field(None, ge=1)
    devices_per_node: int | None = Field(None, ge=1)
    device: str = "a100-80g"
    device_overrides: dict[str, Any] = Field(default_factory=dict)
    profile: str | None = Field(None, description="measured profile JSON (calibration)")


class PlanRecipe(BaseModel):
    """What to plan: an algorithm's dataflow, a model per role, the workload and the cluster.

    Each model is a preset name (``llama2-7b``), a path to a HuggingFace ``config.json`` (or
    its folder; relative to the recipe file) or the config's fields inline.
    """

    model_config = ConfigDict(extra="forbid")

    algorithm: str
    models: dict[str, str | dict[str, Any]]
    workload: Workload = Field(default_factory=Workload)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    top_k: int = Field(3, ge=1)
    base_dir: Path | None = Field(None, exclude=True)

    def dataflow(self) -> Dataflow:
        """The algorithm's dataflow preset."""
        return get_dataflow(self.algorithm)

    def model_specs(self) -> dict[str, ModelSpec]:
        """Resolve every role's model, paths relative to the recipe's folder."""
        return {role: load_model(src, base=self.base_dir) for role, src in self.models.items()}

    def make_cluster(
        self,
        nodes: int | None = None,
        devices_per_node: int | None = None,
        device: str | None = None,
        profile: str | None = None,
    ) -> DeviceCluster:
        """The cluster, command-line values taking precedence over the recipe's."""
        spec = self.cluster
        path = profile or spec.profile
        if path and self.base_dir is not None and not profile and not Path(path).is_absolute():
            path = str(self.base_dir / path)
        return make_cluster(
            nodes=nodes or spec.nodes or 1,
            devices_per_node=devices_per_node or spec.devices_per_node or 8,
            device=device or spec.device,
            overrides=spec.device_overrides,
            profile=path,
        )


def _explain(error: ValidationError, source: str) -> ValueError:
    """One line per problem: the dotted key, what is wrong and the value given."""
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        given = item.get("input")
        lines.append(f"{key}: {item['msg']} (got {given!r})")
    return ValueError(f"invalid plan recipe {source}:\n  " + "\n  ".join(lines))


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> PlanRecipe:
    """Read a recipe YAML, apply ``key=value`` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"plan recipe {str(path)!r} not found")
    try:
        cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ValueError(f"cannot read plan recipe {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"plan recipe {str(path)!r} must be a mapping at the top level")
    try:
        return PlanRecipe.model_validate({**data, "base_dir": path.parent})
    except ValidationError as exc:
        raise _explain(exc, repr(str(path))) from None
