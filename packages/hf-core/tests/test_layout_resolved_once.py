"""One recipe, one layout resolution: ``hybridflow run`` resolves the run's parallel layout
where it loads the recipe, and hands that :class:`~hf_core.config.layout.RunLayout` down --
to the pre-start checks, the memory and sequence checks, placement (the planner's, for
``placement.mode: auto``) and, pickled with their config, to the role workers and their
engines.  Nothing after the load reads the recipe's parallel keys again.

The run goes through the real CLI, trainer, placement and spawning code; only Ray (the cluster,
the resource pools and the worker processes) is replaced: each worker is built in this process
from its pickled arguments, as a worker process would build it, on toy engines that record
the sizes they were given.
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from hf_core import plugins
from hf_core.config import layout as layout_module
from hf_core.resharding import GenerationLayout
from hf_testing.toy_engines import register_toy_engine

COUNTED = ("resolve_layout", "_training_layout", "_generation_layout")
"""The functions that read a recipe's parallel keys (``resolve_layout`` and its two readers)."""
RUN_MODULES = (
    "hf_core.cli",
    "hf_core.trainer.preflight",
    "hf_core.trainer.memory_check",
    "hf_core.trainer.sequence_length",
    "hf_core.trainer.auto_placement",
    "hf_core.trainer.spawning",
    "hf_core.trainer.rl",
    "hf_core.roles.common",
    "hf_core.roles.sequence_capacity",
    "hf_core.roles.actor",
    "hf_core.roles.critic",
    "hf_core.roles.score_model_worker",
)
"""Imported before the counting starts, so each binds the real functions (and gets them back)."""


class ToyTrainingEngine:
    """Records what core passed; no weights."""

    compute_dtype = torch.float32

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class ToyRolloutEngine:
    """A slice-loading rollout engine reporting the generation layout it was built with."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def generation_layout(self) -> GenerationLayout:
        return GenerationLayout(pp=1, tp=self.kwargs.get("tensor_parallel_size", 1))


class TrainingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    head: str
    trainable: bool
    seed: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    tensor_parallel_size: int = 1


@pytest.fixture
def engines() -> Iterator[None]:
    """A megatron-like training backend (tp, pp), an FSDP-like one (none) and a vLLM-like
    rollout backend (tp), with settings models so the checks validate engine arguments."""
    plugins.reset()
    for name, axes in (("mp-toy", ("tp", "pp")), ("dp-toy", ())):
        register_toy_engine(
            "training", name, ToyTrainingEngine, settings=TrainingSettings, axes=axes
        )
    register_toy_engine(
        "rollout", "tp-toy", ToyRolloutEngine, settings=RolloutSettings, axes=("tp",)
    )
    yield
    plugins.reset()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each function of :data:`COUNTED` runs, wherever it was imported into."""
    for module_name in RUN_MODULES:
        importlib.import_module(module_name)
    counts: Counter[str] = Counter()
    for name in COUNTED:
        original = getattr(layout_module, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            counts[_name] += 1
            return _original(*args)

        for module in list(sys.modules.values()):
            if module is not None and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return counts


class _Group:
    """A worker group's stand-in: shutting it down does nothing."""

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return None  # its processes: the trainer only tells colocated groups apart by them


class _Pool:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def release(self) -> None:
        pass


class _Cluster:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *_: object) -> None:
        return None


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Ray replaced: every worker is built here from its pickled arguments (what a worker
    process receives); the trainer's loop returns at once.  Yields the workers by role."""
    import hf_core.trainer.rl as rl
    import hf_core.trainer.run_loop as run_loop
    import hf_core.trainer.spawning as spawning

    built: dict[str, Any] = {}

    def spawn(_pool: Any, specs: dict[str, Any], **_: Any) -> dict[str, _Group]:
        for role, spec in specs.items():
            args, kwargs = pickle.loads(pickle.dumps((spec.args, spec.kwargs)))
            built[role] = spec.cls(*args, **kwargs)
        return {role: _Group() for role in specs}

    monkeypatch.setattr(spawning, "spawn", spawn)
    monkeypatch.setattr(spawning, "ResourcePool", _Pool)
    monkeypatch.setattr(run_loop, "Cluster", _Cluster)
    monkeypatch.setattr(rl.RLTrainer, "_fit", lambda self: None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 0 of the actor's two ranks
    threads = torch.get_num_threads()  # the workers set this process's threads
    try:
        yield built
    finally:
        torch.set_num_threads(threads)


def _recipe(tmp_path: Path, placement: dict[str, Any]) -> Path:
    from hf_testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "policy")
    train = tmp_path / "train.jsonl"
    rows = [{"prompt": f"reverse {i}{i + 1}", "ground_truth": f"{i + 1}{i}"} for i in range(8)]
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = {
        "run": {"output_dir": str(tmp_path / "run"), "progress": False},
        "cluster": {"use_gpu": False},
        "model": {"path": str(model)},
        "data": {"train_files": [str(train)], "batch_size": 4, "max_prompt_length": 32},
        "placement": placement,
        "rollout": {"backend": "tp-toy", "tensor_parallel_size": 2, "n": 2, "max_new_tokens": 8},
        "actor": {"backend": "mp-toy", "parallel": {"tp": 2}},
        "reference": {"backend": "mp-toy", "parallel": {"tp": 2}},
        "critic": {"backend": "dp-toy"},
        "reward": {"model": {"backend": "dp-toy"}},
        "algorithm": {"advantage": "gae"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


@pytest.mark.usefixtures("engines")
@pytest.mark.parametrize(
    "placement",
    [
        {"mode": "colocate", "processes": 2},
        {"mode": "auto", "devices": 2, "device": "cpu"},  # the planner's layout replaces it
    ],
    ids=["colocate", "auto"],
)
def test_hybridflow_run_resolves_the_layout_once(
    tmp_path: Path,
    placement: dict[str, Any],
    calls: Counter[str],
    workers: dict[str, Any],
) -> None:
    from hf_core.cli import main

    assert main(["run", str(_recipe(tmp_path, placement))]) == 0
    assert set(workers) == {"actor", "critic", "reward"}
    # load, checks (engine blocks, memory, sequence length), trainer, placement, spawn and
    # the workers: one resolution, reading each of the recipe's roles once
    assert calls == {"resolve_layout": 1, "_training_layout": 4, "_generation_layout": 1}
    actor = workers["actor"]
    assert actor.actor.kwargs["tensor_parallel_size"] == 2  # the engines got the sizes
    assert actor.rollout.kwargs["tensor_parallel_size"] == 2
    assert actor.layout.generation == GenerationLayout(pp=1, tp=2)
    assert actor.mesh.gen_tp_size == 2  # the worker mesh follows the layout it was given
    assert "tensor_parallel_size" not in workers["critic"].critic.kwargs  # data parallel
