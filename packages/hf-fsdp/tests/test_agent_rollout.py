"""Multi-turn rollouts on the real engine pair: the transformers rollout engine samples the model's
turns (agent loop), the FSDP engine recomputes log-probs and trains on the same tokens.

Checks the two properties multi-turn RL rests on: the rollout log-prob of every model token
equals the training engine's within 1e-4 (the ids trained on are the ids sampled, at the same
positions, with the tool/environment messages attended in between), and tool tokens carry no
loss weight (changing anything at them leaves the gradient unchanged)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hf_core.agents.config import AgentConfig
from hf_core.agents.loop import AgentLoop
from hf_core.batch import Batch
from hf_core.config.schema import AlgorithmConfig
from hf_core.engines import SamplingParams
from hf_core.plugins.tools import resolve_tools
from hf_core.roles.losses import PolicyLoss
from hf_fsdp.engine import FSDPEngine
from hf_fsdp.rollout import TransformersRolloutEngine


class TwoReplies:
    """Answers the first two turns with a tool-style message, then ends the sample."""

    def reset(self, prompt: str) -> None:
        self.left = 2

    def step(self, turn_text: str) -> str | None:
        self.left -= 1
        return None if self.left < 0 else f"result {self.left * 17}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("agent") / "m", vocab_size=256, tool_calls=True)


@pytest.fixture(scope="module")
def trajectories(model: Path) -> Batch:
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    engine = TransformersRolloutEngine({"model_path": str(model), "seed": 3, "dtype": "float32"})
    config = AgentConfig(environment=f"{__name__}:TwoReplies", max_total_tokens=96)
    loop = AgentLoop(engine, tokenizer, config, resolve_tools(config.tools))
    texts = ["12+7=", "reverse 1234:", "3*4=", "hello"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=11)
    return loop.generate(Batch({"input_ids": ids, "attention_mask": mask}), params)


def _tool_positions(batch: Batch) -> torch.Tensor:
    width = batch["responses"].shape[1]
    return batch["attention_mask"][:, -width:].bool() & ~batch["response_mask"].bool()


def test_rollout_log_probs_equal_training_log_probs_on_every_model_token(
    model: Path, trajectories: Batch
) -> None:
    batch = trajectories
    assert batch["agent_turns"].tolist() == [3] * 8  # every sample is multi-turn
    tool = _tool_positions(batch)
    mask = batch["response_mask"].bool()
    # Model tokens come after tool tokens in every row (turns 2 and 3).
    last_tool = tool.float().cumsum(-1).argmax(-1)
    assert all(mask[r, last_tool[r] + 1 :].any() for r in range(len(batch)))
    engine = FSDPEngine({"model_path": str(model), "trainable": False})
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    trained = engine.compute_log_probs(batch.select(*keys), temperature=1.0)["log_probs"]
    diff = (trained - batch["rollout_log_probs"]).abs()
    assert float(diff[mask].max()) < 1e-4
    assert (trained[tool] == 0).all() and (batch["rollout_log_probs"][tool] == 0).all()
    # The comparison can fail: the same tokens without the tool messages score differently.
    shifted = batch.select(*keys)
    shifted["attention_mask"] = shifted["attention_mask"].clone()
    shifted["attention_mask"][:, -tool.shape[1] :][tool] = 0
    without = engine.compute_log_probs(shifted, temperature=1.0)["log_probs"]
    assert float((without - batch["rollout_log_probs"]).abs()[mask].max()) > 1e-2


def _grad_norm(model: Path, batch: Batch) -> float:
    engine = FSDPEngine({"model_path": str(model), "lr": 1e-3, "grad_clip": 1e9})
    update = batch.select(
        "input_ids",
        "attention_mask",
        "position_ids",
        "responses",
        "response_mask",
        "advantages",
        "old_log_probs",
    )
    update.meta["temperature"] = 1.0
    return engine.train_step(update, PolicyLoss(AlgorithmConfig()))["grad_norm"]


def test_tool_tokens_carry_zero_loss_weight(model: Path, trajectories: Batch) -> None:
    batch = trajectories.select(*trajectories.keys())
    gen = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=gen)
    batch["old_log_probs"] = batch["rollout_log_probs"] - 0.05
    tool = _tool_positions(batch)
    base = _grad_norm(model, batch)

    changed = batch.select(*batch.keys())
    changed["advantages"] = batch["advantages"].masked_fill(tool, 1e3)
    changed["old_log_probs"] = batch["old_log_probs"].masked_fill(tool, -50.0)
    assert _grad_norm(model, changed) == pytest.approx(base, rel=1e-5)

    control = batch.select(*batch.keys())  # the same change on model tokens does move it
    model_tokens = batch["response_mask"].bool()
    control["advantages"] = batch["advantages"].masked_fill(model_tokens, 1e3)
    assert _grad_norm(model, control) != pytest.approx(base, rel=1e-2)
