"""Leader CPU generation (hf_fsdp.cpu_leader_rollout) on two real processes: each rank gets back
exactly the rows it would have decoded alone (greedy, float32: the same tokens, log-probs
equal up to float rounding), with its own prompt width when the ranks' prompts differ in
padding; rank 0 decodes with both ranks' threads; and with leader generation on, the engine's token
streams decode per rank, with ranks advancing different numbers of times (a stream's calls are never
collective)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.engines.streaming import StreamRequest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompts(rank: int, width: int) -> Batch:
    """Three left-padded prompts of this rank; ``width`` columns (extra columns: padding)."""
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(3, 60, (3, width), generator=gen)  # within the tiny vocabulary
    mask = torch.ones_like(ids)
    for row, pad in enumerate((width - 5, width - 7, width - 6)):
        mask[row, :pad] = 0
    return Batch({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask})


def _run(rank: int, world: int, port: int, model: str, result: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    from hf_fsdp.rollout import TransformersRolloutEngine

    settings = {"model_path": model, "dtype": "float32", "device": "cpu"}
    # transformers' forward: its streams run in chunks through the engine's own generation
    leader = TransformersRolloutEngine(
        {**settings, "cpu_leader_generation": True, "decoder": "transformers"}
    )
    alone = TransformersRolloutEngine({**settings, "decoder": "transformers"})  # off by default
    params = SamplingParams(temperature=0.0, max_new_tokens=6, n=2)
    prompts = _prompts(rank, width=8 + 3 * rank)  # the ranks' prompt widths differ
    threads: list[int] = []
    decode = leader.generate_here

    def counting(batch: Batch, params: SamplingParams) -> Batch:
        threads.append(torch.get_num_threads())
        return decode(batch, params)

    leader.generate_here = counting  # type: ignore[method-assign]
    got = leader.generate(prompts, params)
    want = alone.generate(prompts, params)
    result[("leader", rank)] = {
        "rows": (len(got), len(want)),
        "widths": (got["input_ids"].shape[1], want["input_ids"].shape[1]),
        "same_keys": sorted(got.keys()) == sorted(want.keys()),
        "same_tokens": all(
            torch.equal(got[k], want[k])
            for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask")
        ),
        "log_prob_diff": float((got["rollout_log_probs"] - want["rollout_log_probs"]).abs().max()),
        "decoded_here_with": threads,
    }
    leader.eos_token_ids = []  # every advance then has a chunk to decode
    stream = leader.open_stream(capacity=4, chunk_tokens=2)
    prompt = prompts["input_ids"][0][prompts["attention_mask"][0].bool()].tolist()
    stream.admit([StreamRequest((0, 0, 0), prompt, SamplingParams(max_new_tokens=6))])
    for _ in range(rank + 1):  # unequal call counts: would hang if they were collective
        stream.advance(version=0)
    result[("per_rank", rank)] = threads[len(result[("leader", rank)]["decoded_here_with"]) :]
    dist.barrier()


@pytest.fixture(scope="module")
def outcome(models: dict[str, Path]) -> dict:
    result = mp.Manager().dict()
    model = str(models["qwen2_tied"])
    mp.spawn(_run, args=(2, _free_port(), model, result), nprocs=2)
    return dict(result)


def test_each_rank_gets_exactly_the_rows_it_would_have_decoded(outcome: dict) -> None:
    for rank in range(2):
        seen = outcome[("leader", rank)]
        assert seen["rows"] == (6, 6)  # 3 prompts x n=2, this rank's only
        assert (
            seen["widths"][0] == seen["widths"][1]
        )  # its own prompt width, not the joined batch's
        assert seen["same_keys"] and seen["same_tokens"]
        assert seen["log_prob_diff"] < 1e-5


def test_rank_zero_decodes_for_both_with_both_ranks_threads(outcome: dict) -> None:
    assert outcome[("leader", 0)]["decoded_here_with"] == [2]
    assert outcome[("leader", 1)]["decoded_here_with"] == []


def test_streams_decode_alone(outcome: dict) -> None:
    assert outcome[("per_rank", 0)] == [1]
    assert outcome[("per_rank", 1)] == [1, 1]
