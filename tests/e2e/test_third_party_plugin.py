"""A package outside the repository extends HybridFlow through its entry point, as a user's
would: built and pip-installed here, it registers an advantage estimator, a policy loss, a KL
estimator, a loss aggregation mode, a reward function and an agent environment, and a GRPO
recipe uses all six by name for two steps (the environment through the agent loop).  A second
package whose entry point raises on import is installed beside it: it is reported and
skipped, and the run (which does not use it) goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_testing.plugin_packages import env_with_site, install_plugin_package

EXTENSIONS = '''
from hf_core.plugins import hookimpl


def half_advantage(token_level_rewards, response_mask, **inputs):
    """Every response token's advantage is 0.5: a value the loss can report back."""
    advantages = 0.5 * response_mask.to(token_level_rewards.dtype)
    return advantages, advantages


def plain_policy_gradient(log_prob, old_log_prob, advantages, response_mask, config=None, **group):
    tokens = response_mask.sum().clamp(min=1)
    loss = -(advantages * log_prob * response_mask).sum() / tokens
    seen = float(advantages[response_mask.bool()].max())
    return loss, {"pg_loss": float(loss.detach()), "third_party_advantage_max": seen}


def shortness(response, ground_truth, extra):
    return 1.0 / (1.0 + len(response))


def quarter_kl(log_prob, ref_log_prob):
    """0.25 on every token whatever the policies: a value the KL loss reports back."""
    return log_prob.new_full(log_prob.shape, 0.25)


def half_token_mean(loss_mat, mask, *, group_ids=None, norm_length=None):
    """Half the token mean: with quarter_kl the logged KL loss is 0.125 only if both ran."""
    return 0.5 * (loss_mat * mask).sum() / mask.sum().clamp(min=1)


class AnswerOnce:
    """Answers a sample's first turn, then ends it: every sample takes exactly two turns."""

    def reset(self, prompt):
        self.answered = False

    def step(self, turn_text):
        if self.answered:
            return None
        self.answered = True
        return "once more"


@hookimpl
def register_advantage_estimators(register):
    register("half_adv", half_advantage, needs_groups=True)


@hookimpl
def register_policy_losses(register):
    register("plain_pg", plain_policy_gradient)


@hookimpl
def register_kl_estimators(register):
    register("quarter_kl", quarter_kl)


@hookimpl
def register_aggregation_modes(register):
    register("half-token-mean", half_token_mean)


@hookimpl
def register_reward_functions(register):
    register("shortness", shortness, batched=False)


@hookimpl
def register_environments(register):
    register("answer_once", AnswerOnce)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("third-party")
    target = tmp / "site"
    install_plugin_package(tmp, "hf-extensions-example", "hf_ext", EXTENSIONS, target)
    install_plugin_package(
        tmp, "hf-broken-example", "hf_broken", "raise ImportError('broken on purpose')\n", target
    )
    return target


def _table_row(table: str, plugin: str) -> str:
    """The text of ``plugin``'s row of the ``hybridflow backends`` table: its line and the
    lines its cells wrap onto (whose first cell is empty)."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"│ {plugin} "))
    row = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("│") or line.split("│")[1].strip():
            break
        row.append(line)
    return " ".join(row)


def test_the_cli_lists_the_extensions_with_their_distribution(site: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hf_core.cli", "backends"],
        capture_output=True,
        text=True,
        env=env_with_site(site),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    row = _table_row(done.stdout, "hf_ext")
    for name in (
        "hf-extensions-example",
        "half_adv",
        "plain_pg",
        "quarter_kl",
        "half-token-mean",
        "shortness",
        "answer_once",
    ):
        assert name in row
    assert "hf-broken-example" in done.stdout and "broken on purpose" in done.stderr


def test_a_recipe_uses_every_third_party_extension_by_name(
    site: Path, in_workdir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    recipe = Path(__file__).parents[2] / "recipes" / "grpo.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_core.cli",
            "run",
            str(recipe),
            f"run.output_dir={out}",
            "run.total_steps=2",
            "run.val_every=2",
            "run.progress=false",
            "algorithm.advantage=half_adv",
            "algorithm.policy_loss=plain_pg",
            "reward.function=shortness",
            "algorithm.kl.estimator=quarter_kl",
            "algorithm.loss_agg_mode=half-token-mean",
            "agent.environment=answer_once",
            "agent.tools=[]",
        ],
        capture_output=True,
        text=True,
        env=env_with_site(site),
        cwd=in_workdir,
        check=False,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "broken on purpose" in done.stderr  # reported, and skipped
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # the plugin's loss ran in the actor on the plugin's estimator's advantages
        assert row["actor/third_party_advantage_max"] == 0.5
        assert 0.0 < row["reward/mean"] < 1.0  # shortness: 1 / (1 + characters)
        # the KL term of the actor's loss: quarter_kl aggregated by half-token-mean
        assert row["actor/kl_loss"] == 0.125
        assert row["agent/turns_mean"] == 2.0  # answer_once answered every first turn
