"""The one resolver for what a recipe names (hf_core.imports.resolve), its errors, the five
loaders that use it, and the hooks for KL estimators, aggregation modes and environments."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_core import plugins
from hf_core.agents.environment import UnknownEnvironmentError, load_environment
from hf_core.agents.function_agents import load_agent_function
from hf_core.algorithms import aggregate_loss, get_aggregation_mode, get_kl_estimator, kl_penalty
from hf_core.errors import ConfigError
from hf_core.imports import UnresolvedReference, resolve
from hf_core.plugins.tools import get_tool
from hf_core.registry import NamedRegistry, UnknownNameError
from hf_core.rewards import UnknownRewardFunctionError, get_reward_function

KEY = "widgets.pick"


@pytest.fixture
def widgets() -> NamedRegistry[int]:
    table: NamedRegistry[int] = NamedRegistry("widget")
    table.add("sprocket", 1)
    table.add("gear", 2)
    return table


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Modules a recipe might name, on sys.path (named per test, so none is cached)."""
    files = {
        "rz_good.py": """
            SCALE = 2.0

            class Box:
                def open(self):
                    return "opened"

            def score(x):
                return x * SCALE
            """,
        "rz_renamed.py": """
            from hf_core.renamed import renamed_attributes

            def new_score(x):
                return x

            __getattr__ = renamed_attributes(__name__, {"old_score": "new_score"}, "clearer")
            """,
        "rz_raises.py": "raise RuntimeError('needs an API key')\n",
        "rz_syntax.py": "def broken(:\n",
        "rz_needs_dep.py": "import rz_not_installed_dependency\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_registered_name_resolves_from_its_table(widgets: NamedRegistry[int]) -> None:
    found = resolve("gear", key=KEY, table=widgets)
    assert (found.name, found.value, found.imported) == ("gear", 2, False)


def test_an_unknown_name_lists_the_known_ones_and_the_closest(
    widgets: NamedRegistry[int],
) -> None:
    with pytest.raises(UnknownNameError) as info:
        resolve("sprockett", key=KEY, table=widgets)
    message = str(info.value)
    assert "unknown widget 'sprockett'; available: gear, sprocket" in message
    assert "did you mean 'sprocket'?" in message


def test_a_module_attr_path_is_imported_dotted_attributes_included(
    modules: Path, widgets: NamedRegistry[int]
) -> None:
    found = resolve("rz_good:score", key=KEY, table=widgets, accept=callable)
    assert found.imported and found.path == "rz_good:score" and found.name == "score"
    assert found.value(3) == 6.0
    method = resolve("rz_good:Box.open", key=KEY).value
    assert method.__qualname__ == "Box.open"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("rz_missing_module:fn", ["cannot import module 'rz_missing_module'", "PYTHONPATH"]),
        ("rz_good.sub:fn", ["cannot import module 'rz_good.sub'"]),
        ("rz_raises:fn", ["cannot import module 'rz_raises'", "RuntimeError: needs an API key"]),
        ("rz_syntax:fn", ["SyntaxError", "rz_syntax.py, line 1"]),
        (
            "rz_needs_dep:fn",
            ["module 'rz_needs_dep'", "ModuleNotFoundError", "rz_not_installed_dependency"],
        ),
        ("rz_good:scor", ["module 'rz_good' has no attribute 'scor'", "did you mean 'score'"]),
        ("rz_good:Box.shut", ["type 'rz_good:Box' has no attribute 'shut'"]),
        ("rz_good:SCALE", ["is a float, not a callable"]),
        (
            "rz_renamed:old_score",
            ["rz_renamed.old_score was renamed new_score (clearer)", "'rz_renamed:new_score'"],
        ),
        ("rz_renamed:absent", ["module 'rz_renamed' has no attribute 'absent'"]),
        ("rz_good:", ["must look like 'package.module:attr'"]),
        (":score", ["must look like"]),
        ("rz good:score", ["must look like"]),
    ],
)
def test_a_bad_path_names_the_key_the_module_and_what_failed(
    modules: Path, spec: str, words: list[str]
) -> None:
    with pytest.raises(UnresolvedReference) as info:
        resolve(spec, key=KEY, accept=callable, expected="a callable")
    message = str(info.value)
    assert message.startswith(f"{KEY} {spec!r}")
    for word in words:
        assert word in message, message


def test_without_a_table_only_paths_are_accepted() -> None:
    with pytest.raises(UnresolvedReference, match=r"widgets\.pick 'gear' must look like 'p:q'"):
        resolve("gear", key=KEY, form="'p:q'")
    with pytest.raises(UnresolvedReference, match="expected a name"):
        resolve("", key=KEY)


def test_each_loader_words_its_errors_for_its_recipe_key(modules: Path) -> None:
    """reward.function, agent.tools, agent.environment and agent.function all go through the
    resolver: the same failure reads the same way, under each loader's own error type."""
    cases = [
        (lambda s: get_reward_function(s, key="cost.function"), UnknownRewardFunctionError),
        (get_tool, ConfigError),
        (load_environment, ConfigError),
        (load_agent_function, ConfigError),
    ]
    keys = ["cost.function", "agent.tools", "agent.environment", "agent.function"]
    for (load, error), key in zip(cases, keys, strict=True):
        with pytest.raises(error) as info:
            load("rz_good:scor")
        assert str(info.value).startswith(f"{key} 'rz_good:scor': module 'rz_good' has no")
    with pytest.raises(ConfigError, match=r"agent\.function 'rz_good:score' is a function, not"):
        load_agent_function("rz_good:score")  # not async
    with pytest.raises(UnknownEnvironmentError, match=r"agent\.environment 'rz_good:SCALE' is a"):
        load_environment("rz_good:SCALE")


# ---------------------------------------------------------------- the new hooks
def constant_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.full_like(log_prob, 0.25)


def half_token_mean(loss_mat, mask, *, group_ids=None, norm_length=None):  # type: ignore[no-untyped-def]
    return 0.5 * (loss_mat * mask).sum() / mask.sum()


class EchoOnce:
    def reset(self, prompt: str) -> None:
        self.prompt = prompt

    def step(self, turn_text: str) -> str | None:
        return None


class TestKit:
    """A run-time plugin implementing the three hooks added beside the older ones."""

    @plugins.hookimpl
    def register_kl_estimators(self, register):  # type: ignore[no-untyped-def]
        register("rz_quarter", constant_kl)

    @plugins.hookimpl
    def register_aggregation_modes(self, register):  # type: ignore[no-untyped-def]
        register("rz-half-token-mean", half_token_mean)

    @plugins.hookimpl
    def register_environments(self, register):  # type: ignore[no-untyped-def]
        register("rz_echo", EchoOnce)


@pytest.fixture
def kit() -> Iterator[None]:
    plugins.reset()
    plugins.add_plugin(TestKit(), "rz-kit")
    yield
    plugins.reset()


@pytest.mark.usefixtures("kit")
def test_kl_estimators_aggregation_modes_and_environments_come_from_hooks() -> None:
    log_prob = torch.zeros(2, 3)
    assert get_kl_estimator("rz_quarter") is constant_kl
    assert torch.equal(kl_penalty(log_prob, log_prob, "rz_quarter"), torch.full((2, 3), 0.25))
    assert get_aggregation_mode("rz-half-token-mean") is half_token_mean
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = aggregate_loss(torch.ones(2, 3), mask, "rz-half-token-mean")
    assert float(loss) == 0.5
    assert load_environment("rz_echo") is EchoOnce
    info = plugins.registry().backends["rz-kit"]
    assert (info.kl_estimators, info.aggregation_modes, info.environments) == (
        ["rz_quarter"],
        ["rz-half-token-mean"],
        ["rz_echo"],
    )
    assert "rz_quarter" in info.algorithms and "rz_echo" in info.rewards_and_agents
    core = plugins.registry().backends["hf-core"]
    assert {"k3", "low_var_kl"} <= set(core.kl_estimators)
    assert "token-mean" in core.aggregation_modes


@pytest.mark.usefixtures("kit")
def test_an_unknown_environment_lists_the_registered_ones() -> None:
    with pytest.raises(UnknownEnvironmentError) as info:
        load_environment("rz_ecko")
    message = str(info.value)
    assert "unknown environment 'rz_ecko'" in message and "rz_echo" in message
    assert "did you mean 'rz_echo'?" in message and "register_environments" in message


def test_a_plugin_registering_a_taken_kl_name_is_a_load_error() -> None:
    class Clash:
        @plugins.hookimpl
        def register_kl_estimators(self, register):  # type: ignore[no-untyped-def]
            register("k3", constant_kl)

    plugins.reset()
    try:
        with pytest.raises(plugins.PluginLoadError, match=r"plugin 'rz-clash'.*'k3'"):
            plugins.add_plugin(Clash(), "rz-clash")
    finally:
        plugins.reset()


def test_an_engine_settings_path_that_does_not_import_names_engine_and_plugin() -> None:
    class Engines:
        @plugins.hookimpl
        def register_training_engines(self, register):  # type: ignore[no-untyped-def]
            register("rz-train", SimpleNamespace, config="rz_no_such_settings:Settings")
            register("rz-train-2", SimpleNamespace, config="hf_core.errors:ConfigError")

    plugins.reset()
    try:
        plugins.add_plugin(Engines(), "rz-engines")
        with pytest.raises(plugins.PluginLoadError) as info:
            plugins.get_engine_config("training", "rz-train")
        message = str(info.value)
        assert "engine 'rz-train' (plugin 'rz-engines')" in message
        assert "cannot import module 'rz_no_such_settings'" in message
        with pytest.raises(plugins.PluginLoadError, match="not a pydantic model class"):
            plugins.get_engine_config("training", "rz-train-2")
    finally:
        plugins.reset()


def test_the_recipe_check_resolves_the_kl_estimator(tmp_path: Path) -> None:
    from hf_core.config import TrainerConfig
    from hf_core.trainer.preflight import preflight

    config = TrainerConfig.model_validate(
        {
            "model": {"path": str(tmp_path)},
            "reward": {"function": "digits_reverse"},
            "rollout": {"n": 2},
            "algorithm": {"kl": {"estimator": "k33"}},
        }
    )
    with pytest.raises(ConfigError) as info:
        preflight(config)
    message = str(info.value)
    assert "algorithm.kl.estimator: unknown KL estimator 'k33'" in message
    assert "did you mean 'k3'?" in message
