"""The 3D-HybridEngine in the running loop (HybridFlow §5.4): megatron TP/PP into TP rollout.

PPO runs 3 steps with a megatron actor (t=2 on 2 ranks; p=2, t=2 on 4 ranks) and a rollout
engine of generation TP t_g=2 in the same processes.  After every sync the log must show the
volume Table 2 gives for the plan in use -- the paper's plan (zero redundancy) or the naive
one ((pt - 1) / pt of the model) -- measured by the transition itself, and greedy generation
after the last sync must equal HF ``generate`` on the weights the actor exports.

Controls, so a rollout engine that never receives new weights cannot pass: the actor trains at
a learning rate that must change greedy outputs (checked against the initial model), every
rank's rollout engine must count the bytes its ``load_weights`` took (``weight_sync/*``, not
the reshard's own counter), and p2t2 is a layout where Table 2 moves bytes to every rank (t2's
share is 0: each rank's TP slices are already its own).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LONG, RECIPES

from hf_core.config import TrainerConfig, load_config
from hf_core.engines import SamplingParams
from hf_core.trainer import RLTrainer
from hf_core.trainer.batches import PROMPT_TENSORS
from hf_testing.handover import check_handover_log
from hf_testing.prompts import prompt_batch

pytestmark = pytest.mark.usefixtures("ray_cluster")

NEW_TOKENS = 8
LR = 1e-2
"""The actor's learning rate: 3 steps at it must change greedy outputs (the control below)."""
LAYOUTS = {  # name: (ranks, t, p)
    "t2": (2, 2, 1),
    "p2t2": (4, 2, 2),
}


class CheckedTrainer(RLTrainer):
    """Runs the recipe, then -- with the worker groups still up -- syncs the last update (each
    rank's sync metrics kept), generates greedily from the rollout engine and exports the
    actor's weights, for the comparison below."""

    greedy: Any = None
    rank_syncs: list[dict[str, float]] | None = None

    def _fit(self) -> Any:
        summary = super()._fit()
        actor = self._groups.actor
        self.rank_syncs = actor.sync_weights()
        prompts = prompt_batch(self.config.model.path, 8)
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
        self.greedy = (prompts, actor.generate(prompts.select(*PROMPT_TENSORS), params))
        actor.export_hf(str(self.output_dir / "exported"))
        return summary


def _run(layout: str, reshard: str, rollout: str, tmp: Path) -> tuple[list[dict], CheckedTrainer]:
    ranks, t, p = LAYOUTS[layout]
    config = load_config(
        TrainerConfig,
        RECIPES / "ppo_megatron.yaml",
        [
            "run.total_steps=3",
            "run.val_every=0",
            "run.progress=false",
            "run.save_every=0",
            "run.save_final=false",
            f"run.output_dir={tmp / f'{layout}_{reshard}_{rollout}'}",
            f"placement.processes={ranks}",
            f"actor.parallel.tp={t}",
            f"actor.parallel.pp={p}",
            f"actor.engine.lr={LR}",
            f"rollout.backend={rollout}",
            "rollout.tensor_parallel_size=2",
            f"rollout.reshard={reshard}",
        ],
    )
    if rollout != "vllm":  # the recipe's engine block holds vLLM settings
        config.rollout = config.rollout.model_copy(update={"engine": {}})
    trainer = CheckedTrainer(config)
    trainer.fit()
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    check_handover_log(trainer.handover_log, ["actor"])  # megatron -> vLLM t_g = 2
    _every_rank_loaded_weights(trainer, ranks)
    return rows, trainer


def _every_rank_loaded_weights(trainer: CheckedTrainer, ranks: int) -> None:
    """The rollout engine's own count of what reached its ``load_weights``, per rank: its
    generation shard -- half of every tensor the actor exports at t_g = 2 (norms whole) --
    however little the all-gathers moved."""
    from safetensors.torch import load_file

    exported = [load_file(f) for f in (trainer.output_dir / "exported").glob("*.safetensors")]
    model = sum(t.numel() * t.element_size() for part in exported for t in part.values())
    syncs = trainer.rank_syncs
    assert syncs is not None and len(syncs) == ranks
    for rank, sync in enumerate(syncs):
        assert model / 2 <= sync["weight_sync/bytes"] <= model, (rank, sync, model)
        assert sync["reshard/bytes_received"] == sync["reshard/bytes_expected"], (rank, sync)


def _hf_greedy(folder: Path, prompts: Any) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    return out[:, prompts["input_ids"].shape[1] :]


def _greedy_matches_export(trainer: CheckedTrainer) -> None:
    prompts, out = trainer.greedy
    expected = _hf_greedy(trainer.output_dir / "exported", prompts)
    # control: training changed greedy outputs, so stale rollout weights would show below
    assert not torch.equal(expected, _hf_greedy(trainer.config.model.path, prompts))
    width = expected.shape[1]
    mask = out["response_mask"][:, :width].bool()
    assert mask.any()
    assert torch.equal(out["responses"][:, :width][mask], expected[mask])


@pytest.mark.parametrize("layout", [pytest.param("t2", marks=LONG), "p2t2"])
def test_paper_plan_moves_table2_volume_with_zero_redundancy(
    layout: str, in_workdir: Path, tmp_path: Path
) -> None:
    rows, trainer = _run(layout, "hybrid", "vllm", tmp_path)
    _, t, p = LAYOUTS[layout]
    # Table 2, HybridFlow: (pt - t_g p_g) / (t_g p_g pt) of M
    share = Fraction(t * p - 2, 2 * t * p)
    for row in rows:
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"]
        assert row["reshard/zero_redundancy"] == 1.0
        assert row["reshard/bytes_received"] == share * row["reshard/model_bytes"]
        assert row["perf/weight_sync_s"] > 0
        assert row["memory/weight_sync_peak_gib"] > 0
    for sync in trainer.rank_syncs or []:  # every rank, not the log's worst one
        assert sync["reshard/bytes_received"] == share * sync["reshard/model_bytes"]
        assert sync["reshard/bytes_received"] > 0 or layout == "t2"
    _greedy_matches_export(trainer)


@pytest.mark.parametrize("layout", ["t2", pytest.param("p2t2", marks=LONG)])
def test_naive_plan_moves_the_naive_volume(layout: str, in_workdir: Path, tmp_path: Path) -> None:
    rows, trainer = _run(layout, "naive", "vllm", tmp_path)
    _, t, p = LAYOUTS[layout]
    for row in [*rows, *(trainer.rank_syncs or [])]:  # the log's rows, then every rank's
        naive = Fraction(t * p - 1, t * p) * row["reshard/model_bytes"]  # (tp - 1) / tp * M
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"] == naive > 0
        assert row["reshard/zero_redundancy"] == 0.0
    _greedy_matches_export(trainer)
