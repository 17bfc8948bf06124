"""Bad inputs fail with exit code 2 and one message naming what and where, before Ray starts
and before anything is written to the run's output folder; failures inside a run exit 1 with
the way to resume, Ctrl-C exits 130.

Every bad-input case goes through ``hf_core.cli.main`` with ``ray.init`` replaced by a recorder,
so a check that slipped behind the start of the cluster fails the test instead of starting one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import RECIPES

from hf_core.cli import main

GRPO = str(RECIPES / "grpo.yaml")
PPO = str(RECIPES / "ppo.yaml")
REASONING_GYM = str(RECIPES / "reasoning_gym.yaml")


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", GRPO, "run.progress=false", *args])
    return code, " ".join(capsys.readouterr().err.split())


def _nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Calls to ``ray.init`` (there must be none before the inputs are checked)."""
    import ray

    started: list[object] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    return started


# ------------------------------------------------------------------ the bad inputs

Setup = Callable[[Path, Path], list[str]]
"""(scratch folder, the assets folder) -> the words after ``hybridflow run`` (recipe first)."""


@dataclass(frozen=True)
class Bad:
    """One bad input: how to make it, and what its message must say."""

    id: str
    setup: Setup
    says: tuple[str, ...]


def _grpo(*overrides: str) -> Setup:
    return lambda tmp, assets: [GRPO, *overrides]


def _policy_copy(tmp: Path, assets: Path, change: Callable[[Path], None]) -> Path:
    """A copy of the tiny policy folder with one thing broken by ``change``."""
    folder = tmp / "policy"
    shutil.copytree(assets / "policy", folder)
    change(folder)
    return folder


def _seventy_billion(folder: Path) -> None:
    """The policy's config grown to a Llama-70B shape (the weight files stay tiny: the memory
    check reads config.json, before anything loads weights)."""
    config = json.loads((folder / "config.json").read_text())
    config.update(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    )
    (folder / "config.json").write_text(json.dumps(config))


def _with_policy(change: Callable[[Path], None], key: str = "model.path") -> Setup:
    def setup(tmp: Path, assets: Path) -> list[str]:
        folder = _policy_copy(tmp, assets, change)
        extra = [f"model.tokenizer_path={assets / 'policy'}"] if key == "model.path" else []
        return [GRPO, f"{key}={folder}", *extra]

    return setup


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _remove(*names: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        for name in names:
            (folder / name).unlink()

    return change


def _bad_yaml(tmp: Path, assets: Path) -> list[str]:
    recipe = tmp / "broken.yaml"
    recipe.write_text("run:\n  name: x\nmodel:\n  path: [runs/assets/policy\ndata: {}\n")
    return [str(recipe)]


def _train_file(text: str) -> Setup:
    def setup(tmp: Path, assets: Path) -> list[str]:
        path = tmp / "train.jsonl"
        path.write_text(text)
        return [GRPO, f"data.train_files=[{path}]"]

    return setup


def _broken_jsonl(tmp: Path, assets: Path) -> list[str]:
    lines = (assets / "train.jsonl").read_text().splitlines()[:5]
    lines[3] = '{"prompt": "reverse 123:", "ground_truth": '
    return _train_file("\n".join(lines) + "\n")(tmp, assets)


def _module_raising_on_import(tmp: Path, assets: Path) -> list[str]:
    (tmp / "raising_rewards.py").write_text("raise RuntimeError('needs an API key')\n")
    sys.path.insert(0, str(tmp))  # removed again by the test (see test_bad_input)
    return [GRPO, "reward.function=raising_rewards:score"]


def _empty_output_folder(tmp: Path, assets: Path) -> list[str]:
    return [GRPO, "--resume"]  # the test creates the output folder, empty


BAD_INPUTS = [
    # recipe and overrides
    Bad(
        "yaml-syntax",
        _bad_yaml,
        ("broken.yaml, line 5, column 5: YAML syntax error", "started at line 4, column 9"),
    ),
    Bad(
        "recipe-missing",
        lambda tmp, assets: [str(tmp / "nope.yaml")],
        ("recipe file not found", "nope.yaml"),
    ),
    Bad("override-without-equals", _grpo("rollout.n"), ("key=value", "['rollout.n']")),
    Bad("override-unknown-key", _grpo("actor.lrr=1"), ("actor.lrr: unknown key",)),
    Bad("wrong-type", _grpo("data.batch_size=abc"), ("data.batch_size: got 'abc'", "integer")),
    # reward functions, resolved while the recipe loads
    Bad(
        "reward-unknown-name",
        _grpo("reward.function=digits_revers"),
        ("reward.function: unknown reward function 'digits_revers'", "'digits_reverse'"),
    ),
    Bad(
        "reward-module-missing",
        _grpo("reward.function=no_such_rewards:score"),
        ("reward.function", "cannot import module 'no_such_rewards'"),
    ),
    # agent tools and environments, resolved on the driver before workers start
    Bad(
        "agent-unknown-tool",
        _grpo("agent={tools: [calculater]}"),
        ("agent: unknown tool 'calculater'", "'calculator'"),
    ),
    Bad(
        "agent-environment-missing",
        _grpo("agent={environment: no_such_envs:Game}"),
        ("agent.environment 'no_such_envs:Game'", "cannot import"),
    ),
    Bad(
        "reward-module-raises",
        _module_raising_on_import,
        ("reward.function", "raising_rewards", "RuntimeError: needs an API key"),
    ),
    Bad(
        "reward-function-missing",
        _grpo("reward.function=bad_rewards:nope"),
        ("reward.function", "'bad_rewards' has no attribute 'nope'"),
    ),
    Bad(
        "reward-not-callable",
        _grpo("reward.function=bad_rewards:NOT_A_FUNCTION"),
        ("reward.function", "'bad_rewards:NOT_A_FUNCTION' is a str, not a callable"),
    ),
    # backends and engine blocks
    Bad(
        "rollout-backend",
        _grpo("rollout.backend=transformer"),
        ("rollout.backend", "'transformers'"),
    ),
    Bad("training-backend", _grpo("actor.backend=fsdpp"), ("actor.backend", "'fsdp'")),
    Bad("engine-key", _grpo("actor.engine.lrr=1"), ("actor.engine.lrr: unknown key",)),
    Bad("engine-negative-lr", _grpo("actor.engine.lr=-1"), ("actor.engine.lr: got -1",)),
    Bad("algorithm-name", _grpo("algorithm.advantage=grpoo"), ("did you mean 'grpo'",)),
    # model folders and the tokenizer
    Bad(
        "model-path-missing",
        _grpo("model.path=nowhere/policy"),
        ("model.path: model folder", "nowhere/policy does not exist"),
    ),
    Bad(
        "config-json-empty",
        _with_policy(_write("config.json", "")),
        ("model.path:", "policy/config.json is empty"),
    ),
    Bad(
        "config-json-not-json",
        _with_policy(_write("config.json", '{"model_type": "qwen2",\n')),
        ("model.path:", "policy/config.json is not valid JSON (line 2, column 1"),
    ),
    Bad(
        "no-weights",
        _with_policy(_remove("model.safetensors")),
        ("model.path:", "policy has no model.safetensors", "safe_serialization=True"),
    ),
    Bad(
        "weights-truncated",
        _with_policy(_write("model.safetensors", "garbage")),
        (
            "model.path:",
            "policy/model.safetensors is not a safetensors file",
        ),
    ),
    Bad(
        "tokenizer-missing",
        _with_policy(_remove("tokenizer.json", "tokenizer_config.json"), "model.tokenizer_path"),
        ("model.tokenizer_path:", "policy has no tokenizer files"),
    ),
    Bad(
        "tokenizer-unloadable",
        _with_policy(_write("tokenizer.json", "{}"), "model.tokenizer_path"),
        ("model.tokenizer_path:", "policy/tokenizer.json is not a tokenizer file"),
    ),
    Bad(
        "critic-model-missing",
        lambda tmp, assets: [PPO, "critic.model_path=nowhere/critic"],
        ("critic.model_path: model folder", "nowhere/critic does not exist"),
    ),
    # prompt data
    Bad(
        "train-file-missing",
        _grpo("data.train_files=[nowhere.jsonl]"),
        ("data.train_files[0]", "nowhere.jsonl does not exist"),
    ),
    Bad("train-files-none", _grpo("data.train_files=[]"), ("data.train_files: empty",)),
    Bad("train-file-empty", _train_file(""), ("data.train_files[0]", "train.jsonl is empty")),
    Bad("jsonl-line", _broken_jsonl, ("train.jsonl: line 4: malformed JSON",)),
    Bad(
        "prompt-key-missing",
        _grpo("data.prompt_key=question"),
        ("train.jsonl: record 0 (line 1): missing prompt key 'question'", "data.prompt_key"),
    ),
    # algorithm and layout consistency
    Bad("grpo-n-1", _grpo("rollout.n=1"), ("rollout.n must be >= 2 (got 1)",)),
    Bad(
        "batch-not-divisible",
        _grpo("placement.processes=3"),
        ("data.batch_size * rollout.n = 32 samples must split evenly into 3 ranks",),
    ),
    Bad(
        "transformers-rollout-tp2",
        _grpo("rollout.tensor_parallel_size=2"),
        ("rollout.tensor_parallel_size: 2", "'transformers' rollout engine cannot split a model"),
    ),
    Bad(
        "megatron-sequence-parallel",
        lambda tmp, assets: [str(RECIPES / "ppo_megatron.yaml"), "actor.parallel.sp=2"],
        ("actor.parallel.sp: 2", "'megatron' training engine cannot split a sequence"),
    ),
    Bad(
        "sequence-parallel-not-dividing-the-pool",
        _grpo("actor.parallel.sp=3", "reference.parallel.sp=3"),
        ("actor.parallel.sp: 3 ranks split each sequence", "pool of 2 processes"),
    ),
    Bad(
        "response-past-the-models-positions",
        _grpo("rollout.max_new_tokens=600"),
        ("a sequence may reach 600 tokens", "the model has 512 positions"),
    ),
    # a run that cannot fit this machine says so before it starts
    Bad(
        "model-too-large",
        _with_policy(_seventy_billion),
        (
            "the actor's processes cannot fit this machine",
            "estimated peak",
            "state",
            "against a budget of",
            "per process",
        ),
    ),
    # environments: the library's names and settings, checked before Ray starts
    Bad(
        "env-unknown-task",
        lambda tmp, assets: [REASONING_GYM, "env.tasks={basic_arithmetc: 1}"],
        ("env.task: unknown reasoning-gym task 'basic_arithmetc'", "did you mean basic_arithmetic"),
    ),
    Bad(
        "env-unknown-kind",
        lambda tmp, assets: [REASONING_GYM, "env.kind=reasoning-gym"],
        ("env.kind: unknown environment kind 'reasoning-gym'", "reasoning_gym"),
    ),
    Bad(
        "env-and-data-files",
        lambda tmp, assets: [REASONING_GYM, f"data.train_files=[{assets / 'train.jsonl'}]"],
        ("the environment gives the prompts and the reward", "data.train_files"),
    ),
    Bad(
        "env-bad-generator-setting",
        lambda tmp, assets: [REASONING_GYM, "env.task_config.leg_counting.min_animals=many"],
        ("env.task_config.leg_counting: reasoning-gym refused the settings",),
    ),
    # checkpoints
    Bad(
        "resume-no-output-folder",
        _grpo("--resume"),
        ("--resume: the output folder", "does not exist", "run without --resume"),
    ),
    Bad(
        "resume-no-checkpoint",
        _empty_output_folder,
        ("--resume: no checkpoint to resume from", "checkpoints/latest does not exist"),
    ),
]


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[b.id for b in BAD_INPUTS])
def test_bad_input(
    bad: Bad,
    in_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_ray: list[object],
) -> None:
    out = tmp_path / "out"
    if bad.id == "resume-no-checkpoint":
        out.mkdir()
    path = list(sys.path)
    try:
        words = bad.setup(tmp_path, in_workdir / "runs" / "assets")
        code = main(["run", *words, f"run.output_dir={out}", "run.progress=false"])
    finally:
        sys.path[:] = path
    raw = capsys.readouterr().err
    err = " ".join(raw.split())
    assert code == 2, raw
    for text in bad.says:
        assert text in err, raw
    assert raw.startswith("error: ") and "\n\n" not in raw.strip(), raw  # one paragraph
    assert "Traceback" not in raw and "[bold" not in raw and "sentencepiece" not in raw, raw
    assert not no_ray, "Ray was started before the inputs were checked"
    _nothing_written(out)
    if bad.id.startswith("resume"):
        assert out.exists() == (bad.id == "resume-no-checkpoint"), "--resume created the folder"


def test_bad_input_from_the_shell(in_workdir: Path, tmp_path: Path) -> None:
    """The real entry point: exit code 2, the message, no traceback."""
    recipe = tmp_path / "broken.yaml"
    _bad_yaml(tmp_path, in_workdir)
    result = subprocess.run(
        [sys.executable, "-m", "hf_core.cli", "run", str(recipe), "--resume", "rollout.n=8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "broken.yaml, line 5, column 5: YAML syntax error" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_reward_function_that_raises_is_not_checked_at_load(
    in_workdir: Path, capsys: pytest.CaptureFixture[str], no_ray: list[object]
) -> None:
    """A reward function that resolves passes the load checks (it fails only when it runs:
    see test_reward_function_that_raises)."""
    from hf_core.trainer.preflight import load_run_config

    config, _ = load_run_config(GRPO, ["reward.function=bad_rewards:explode_on_long"])
    assert config.reward.function == "bad_rewards:explode_on_long" and not no_ray


# ------------------------------------------------------------- options in any order


class _RecordingTrainer:
    """Stands in for RLTrainer: records what the CLI built, runs nothing."""

    calls: ClassVar[list[tuple[object, bool]]] = []

    def __init__(self, config: object, *, resume: bool = False, layout: object = None) -> None:
        self.calls.append((config, resume))

    def fit(self) -> None:
        return None


def _save_checkpoint(out: Path, step: int = 3) -> Path:
    from hf_core.trainer.checkpoint import save_run_checkpoint

    return save_run_checkpoint(out, step, {"step": step}, lambda folder: None)


@pytest.mark.parametrize(
    "words",
    [
        ["{recipe}", "--resume", "rollout.n=8", "{out}"],
        ["--resume", "{recipe}", "rollout.n=8", "{out}"],
        ["{recipe}", "rollout.n=8", "--resume", "{out}"],
    ],
    ids=["recipe-resume-override", "resume-recipe-override", "recipe-override-resume"],
)
def test_options_and_overrides_in_any_order(
    words: list[str], in_workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf_core.trainer.choice

    out = tmp_path / "out"
    _save_checkpoint(out)
    monkeypatch.setattr(hf_core.trainer.choice, "trainer_class", lambda _: _RecordingTrainer)
    _RecordingTrainer.calls = []
    argv = [w.format(recipe=GRPO, out=f"run.output_dir={out}") for w in words]
    assert main(["run", *argv]) == 0
    (config, resume), *_ = _RecordingTrainer.calls
    assert resume and config.rollout.n == 8 and config.run.output_dir == out  # type: ignore[attr-defined]


def test_an_unknown_option_is_still_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", GRPO, "--no-such-option", "rollout.n=8"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


# ------------------------------------------------------- failures inside a run


def _raise(exc: BaseException, restarts: int = 0) -> Callable[..., None]:
    def fit(self: object) -> None:
        self.restarts = [f"lost {i}" for i in range(restarts)]  # type: ignore[attr-defined]
        raise exc

    return fit


REMOTE_TB = (
    "Traceback (most recent call last):\n"
    '  File "hf_fsdp/engine.py", line 412, in update_actor\n'
    "ValueError: loss is nan at micro-batch 3\n"
)


@pytest.mark.parametrize("saved", [True, False], ids=["with-checkpoint", "no-checkpoint"])
def test_worker_error_is_one_paragraph_and_error_log(
    saved: bool,
    in_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_ray: list[object],
) -> None:
    from hf_core.runtime import WorkerError
    from hf_core.trainer import RLTrainer

    out = tmp_path / "out"
    checkpoint = _save_checkpoint(out) if saved else None
    error = WorkerError("actor", 1, "update_actor", "ValueError", "loss is nan", REMOTE_TB)
    monkeypatch.setattr(RLTrainer, "fit", _raise(error))
    code = main(["run", GRPO, "rollout.n=8", f"run.output_dir={out}"])
    raw = capsys.readouterr().err
    err = " ".join(raw.split())
    assert code == 1, raw
    assert "role 'actor' rank 1 raised in 'update_actor': ValueError: loss is nan" in err
    assert f"Full tracebacks: {out / 'error.log'}" in err
    if checkpoint is not None:
        assert f"Latest checkpoint: {checkpoint}" in err
        assert (
            f"Resume with: hybridflow run {GRPO} rollout.n=8 run.output_dir={out} --resume" in err
        )
    else:
        assert "No checkpoint was saved" in err and "--resume" not in err
    assert "Traceback" not in raw and "\n\n" not in raw.strip()
    log = (out / "error.log").read_text()
    assert REMOTE_TB in log and "driver traceback" in log


def test_lost_worker_names_role_rank_method(
    in_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hf_core.runtime import WorkerLostError
    from hf_core.trainer import RLTrainer

    out = tmp_path / "out"
    lost = WorkerLostError("rollout", 0, "generate", "no heartbeat for 30 s")
    wrapped = RuntimeError("gave up after 2 restarts")
    wrapped.__cause__ = lost  # the trainer may wrap it; the CLI finds it
    monkeypatch.setattr(RLTrainer, "fit", _raise(wrapped, restarts=2))
    code = main(["run", GRPO, f"run.output_dir={out}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1
    assert "the run failed (after 2 restarts): role 'rollout' rank 0 was lost" in err
    assert "during 'generate': no heartbeat for 30 s" in err
    assert "worker lost" in (out / "error.log").read_text()


@pytest.mark.parametrize("saved", [True, False], ids=["with-checkpoint", "no-checkpoint"])
def test_ctrl_c_is_one_line_and_exit_130(
    saved: bool,
    in_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hf_core.trainer import RLTrainer

    out = tmp_path / "out"
    checkpoint = _save_checkpoint(out) if saved else None
    monkeypatch.setattr(RLTrainer, "fit", _raise(KeyboardInterrupt()))
    code = main(["run", GRPO, f"run.output_dir={out}"])
    raw = capsys.readouterr().err
    assert code == 130
    assert raw.count("\n") == 1 and raw.startswith("interrupted: "), raw
    if checkpoint is not None:
        assert f"latest checkpoint: {checkpoint}; resume with: hybridflow run" in raw
    else:
        assert f"no checkpoint was saved in {out}" in raw
    assert not (out / "error.log").exists()


# ------------------------------------------------------------- a real run (Ray)


@pytest.mark.usefixtures("ray_cluster")
def test_reward_function_that_raises(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_workdir / "runs" / "bad_reward"
    code, err = _run_cli(
        capsys,
        f"run.output_dir={out}",
        "reward.function=bad_rewards:explode_on_long",
        "run.total_steps=2",
    )
    assert code == 2
    assert "bad_rewards:explode_on_long" in err or "explode_on_long" in err
    assert "sample 0" in err and "cannot score this" in err
    assert not (out / "checkpoints").exists()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # only complete rows, if any
