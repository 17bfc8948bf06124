"""The agent demo, short: a few multi-turn GRPO steps with the calculator tool, on the HF and
the vLLM rollout engines (FSDP actor), after a short SFT warm start on tool-call examples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import FLOAT32_ROLLOUT, LONG, RECIPES, load_script

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer

AGENT_KEYS = (
    "agent/turns_mean",
    "agent/tool_calls_mean",
    "agent/tool_errors_mean",
    "agent/tool_timeouts_mean",
    "agent/tool_tokens_mean",
)
VLLM = ["rollout.engine={kv_cache_bytes: 268435456}"]


def _demo_module():
    return load_script(RECIPES / "demo_tools.py")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _demo_module().build_assets(tmp_path_factory.mktemp("agent") / "assets")


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("backend", [pytest.param("transformers", marks=LONG), "vllm"])
def test_agent_demo_runs_multi_turn_steps(
    backend: str, assets: dict[str, str], in_workdir: Path
) -> None:
    if backend == "vllm":
        pytest.importorskip("hf_vllm")
    overrides = [f"{k}={v}" for k, v in assets.items()] + [
        f"rollout.backend={backend}",
        f"run.output_dir=runs/agent_{backend}",
        "run.total_steps=3",
        "run.progress=false",
        "sft.steps=60",
        "actor.engine.lr=1.0e-3",
        *(VLLM if backend == "vllm" else []),
        FLOAT32_ROLLOUT,  # the log-prob check below is float32's
    ]
    config = load_config(TrainerConfig, RECIPES / "demo_tools.yaml", overrides)
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        for key in AGENT_KEYS:
            assert math.isfinite(row[key]), f"{backend}: {key} = {row[key]}"
        assert row["agent/turns_mean"] >= 1
    # After the warm start the policy calls the tool: multi-turn samples with masked tool
    # tokens, whose model tokens the trainer's log-probs still match.
    assert max(row["agent/tool_calls_mean"] for row in rows) > 0
    assert max(row["agent/tool_tokens_mean"] for row in rows) > 0
    assert max(row["agent/turns_mean"] for row in rows) > 1
    # Float32 model: both engines match the FSDP forward within 1e-4 on every model token.
    worst = max(row["rollout/logprob_abs_diff_max"] for row in rows)
    assert worst < 1e-4, f"{backend}: rollout vs training log-prob max diff {worst}"


@pytest.mark.usefixtures("ray_cluster")
def test_agent_loop_streams_on_a_rollout_pool(assets: dict[str, str], in_workdir: Path) -> None:
    """``rollout.mode: streaming`` with the agent loop: each submission one agent call on the
    standalone pool, groups handed to the trainer, updates landing between calls."""
    overrides = [f"{k}={v}" for k, v in assets.items()] + [
        "run.output_dir=runs/agent_stream",
        "run.total_steps=3",
        "run.progress=false",
        "sft.steps=60",
        "actor.engine.lr=1.0e-3",
        "placement.mode=standalone",
        "placement.processes=1",
        "placement.rollout_processes=1",
        "rollout.mode=streaming",
        "rollout.max_staleness=1",
        FLOAT32_ROLLOUT,
    ]
    config = load_config(TrainerConfig, RECIPES / "demo_tools.yaml", overrides)
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["async/staleness_max"] <= 1 for row in rows)
    assert all(row["stream/interrupted_samples"] == 0 for row in rows)  # never inside a call
    assert max(row["agent/tool_calls_mean"] for row in rows) > 0
    assert max(row["agent/turns_mean"] for row in rows) > 1
    ledger = (config.run.output_dir / "prompt_ledger.jsonl").read_text().splitlines()
    trained = [json.loads(line) for line in ledger if '"trained"' in line]
    assert len(trained) == 3 * config.data.batch_size
