"""Recipe loading: YAML + dotted overrides, errors that name key, value and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_core.agents.config import SandboxConfig
from hf_core.config import ConfigError, TrainerConfig, describe_fields, load_config
from hf_core.trainer.preflight import load_run_config

RECIPE = """
model: {path: models/policy}
data: {train_files: [data/train.jsonl], batch_size: 4}
rollout: {n: 4}
reward: {function: digits_reverse}
"""


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def test_yaml_and_overrides(recipe: Path) -> None:
    config = load_config(TrainerConfig, recipe, ["rollout.n=8", "algorithm.kl.coef=0.5"])
    assert config.rollout.n == 8 and config.algorithm.kl.coef == 0.5
    assert config.model.path.is_absolute()  # workers do not share the driver's cwd
    assert config.tokenizer_path == config.model.path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.lrr=1"], "actor.lrr: unknown key"),
        (["rollout.n=many"], "rollout.n: got 'many'"),
        (["rollout.temperature=-1"], "rollout.temperature: got -1"),
        (["rollout.n=1"], "rollout.n must be >= 2"),
        (["algorithm.advantage=gae"], "needs a 'critic' section"),
        (["algorithm.kl.mode=in_loss"], "needs a 'reference'"),
        (["algorithm.mini_batches=3"], "must split evenly"),
        (["algorithm.advantage=gea"], "algorithm.advantage: unknown advantage estimator 'gea'"),
        (["algorithm.policy_loss=ppo"], "algorithm.policy_loss: unknown policy loss 'ppo'"),
        (["just-a-word"], "overrides must look like key=value"),
        (["placement.processes=3", "placement.nodes=2"], "placement.nodes=2 must divide"),
        (["reward.weight=0"], "nothing to train on without a 'teacher'"),
        (["teacher.backend=fsdp"], "teacher.model_path: give the teacher's weights"),
        (
            ["teacher.model_path=models/teacher", "algorithm.distill.estimator=k9"],
            "algorithm.distill.estimator: unknown KL estimator 'k9'",
        ),
        (["algorithm.dynamic_sampling.max_rounds=-1"], "max_rounds"),
    ],
)
def test_errors_name_the_key(recipe: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(recipe, overrides)


@pytest.mark.parametrize(
    ("override", "guess", "block", "keys"),
    [
        ("rollout.max_stalenes=1", "rollout.max_staleness", "rollout", {"n", "bucket_mb"}),
        ("actor.parallel.tpp=2", "actor.parallel.tp", "actor.parallel", {"tp", "pp"}),
        ("algorithm.kl.coeff=0.1", "algorithm.kl.coef", "algorithm.kl", {"estimator", "target"}),
    ],
)
def test_an_unknown_nested_key_lists_its_own_block(
    recipe: Path, override: str, guess: str, block: str, keys: set[str]
) -> None:
    """Depth 2 and 3: the keys of the block the typo sits in, and the nearest of them, not
    the top level's keys."""
    with pytest.raises(ConfigError) as info:
        load_config(TrainerConfig, recipe, [override])
    text = str(info.value)
    assert f"did you mean {guess}?" in text
    listed = text.split(f"(keys of {block}: ")[1].split(")")[0].split(", ")
    assert keys <= set(listed)
    assert "run" not in listed and "placement" not in listed  # not the top level's keys


def test_an_unknown_key_far_from_every_known_one_gets_no_guess(recipe: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TrainerConfig, recipe, ["rollout.wormhole=streaming"])
    text = str(info.value)
    assert "rollout.wormhole: unknown key (got 'streaming') (keys of rollout: " in text
    assert "did you mean" not in text


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(TrainerConfig, tmp_path / "nope.yaml")


def test_field_listing_covers_nested_sections() -> None:
    keys = {key for key, _, _ in describe_fields(TrainerConfig)}
    assert {"run.total_steps", "algorithm.kl.coef", "rollout.n", "model.path"} <= keys


def test_yaml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  name: x\n\tbad: 1\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml, line 3, column 1: YAML syntax error"):
        load_config(TrainerConfig, path)


def test_cross_field_errors_read_as_the_validators_text(recipe: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TrainerConfig, recipe, ["rollout.n=3", "placement.processes=8"])
    text = str(info.value)
    assert "\n  data.batch_size * rollout.n = 12 samples must split evenly" in text
    assert "<root>" not in text and "Value error" not in text


def test_override_with_empty_key_is_rejected(recipe: Path) -> None:
    with pytest.raises(ConfigError, match="overrides must look like key=value"):
        load_config(TrainerConfig, recipe, ["=3"])


def test_the_sandbox_section(recipe: Path) -> None:
    assert load_config(TrainerConfig, recipe).sandbox == SandboxConfig()  # local by default
    config = load_config(
        TrainerConfig, recipe, ["sandbox.kind=remote", "sandbox.url=http://10.0.0.7:8080/"]
    )
    assert (config.sandbox.kind, config.sandbox.url) == ("remote", "http://10.0.0.7:8080")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sandbox.kind=remote"], "\n  sandbox.url is required when sandbox.kind is remote"),
        (["sandbox.kind=docker"], "sandbox.kind: got 'docker'"),
        (["sandbox.url=localhost:8080"], "sandbox.url: got 'localhost:8080': must be an http"),
        (
            ["sandbox.ur=http://x"],
            "sandbox.ur: unknown key (got 'http://x'); did you mean sandbox.url?",
        ),
        (["sandbox.request_timeout_s=0"], "sandbox.request_timeout_s: got 0"),
    ],
)
def test_the_sandbox_section_is_checked(recipe: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TrainerConfig, recipe, overrides)
    assert message in str(info.value)
    assert "Value error" not in str(info.value)


def test_overlong_shaping_is_off_by_default_and_set_by_keys(recipe: Path) -> None:
    default = load_config(TrainerConfig, recipe).algorithm.overlong
    assert (default.buffer, default.penalty_factor, default.filter_truncated) == (0, 1.0, False)
    config = load_config(
        TrainerConfig,
        recipe,
        [
            "rollout.max_new_tokens=64",
            "algorithm.overlong.buffer=16",
            "algorithm.overlong.penalty_factor=0.5",
            "algorithm.overlong.filter_truncated=true",
        ],
    )
    overlong = config.algorithm.overlong
    assert (overlong.buffer, overlong.penalty_factor, overlong.filter_truncated) == (16, 0.5, True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.max_new_tokens=32", "algorithm.overlong.buffer=32"],
            "algorithm.overlong.buffer=32 must be < rollout.max_new_tokens=32",
        ),
        (["algorithm.overlong.buffer=-1"], "algorithm.overlong.buffer: got -1"),
        (["algorithm.overlong.penalty_factor=-1"], "algorithm.overlong.penalty_factor: got -1"),
        (["algorithm.overlong.bufer=4"], "did you mean algorithm.overlong.buffer?"),
        (["algorithm.rollout_is=sequence"], "algorithm.rollout_is: got 'sequence'"),
        (["algorithm.clip_ratio_low=1.5"], "algorithm.clip_ratio_low: got 1.5"),
        (["algorithm.policy_loss=gsp"], "unknown policy loss 'gsp'"),
    ],
)
def test_the_new_algorithm_keys_are_checked(
    recipe: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(recipe, overrides)
    assert message in str(info.value)


def test_sequence_rollout_corrections_and_cispo_bounds_are_accepted(recipe: Path) -> None:
    for mode in ("seq_truncated", "seq_masked"):
        config = load_config(TrainerConfig, recipe, [f"algorithm.rollout_is={mode}"])
        assert config.algorithm.rollout_is == mode
    overrides = ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=1.0"]
    assert load_config(TrainerConfig, recipe, overrides).algorithm.clip_ratio_low == 1.0


def test_gspo_with_another_aggregation_is_warned_about_when_the_recipe_loads(
    recipe: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GSPO is defined as a mean over responses: the driver says so once, before any worker."""
    for mode, warned in (("token-mean", True), ("seq-mean-token-mean", False)):
        caplog.clear()
        overrides = ["algorithm.policy_loss=gspo", f"algorithm.loss_agg_mode={mode}"]
        with caplog.at_level("WARNING", logger="hf_core.trainer.preflight"):
            try:
                load_run_config(recipe, overrides)
            except ConfigError:
                pass  # the recipe's model folder does not exist: checked after the algorithm
        said = [r.getMessage() for r in caplog.records if r.name == "hf_core.trainer.preflight"]
        assert bool(said) == warned, (mode, said)
        if warned:
            assert "loss_agg_mode=seq-mean-token-mean" in said[0]
