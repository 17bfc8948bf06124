"""Generation tensor parallelism inside the training ranks (t_g = 2, external_launcher).

The two FSDP ranks together form ONE vLLM engine with tensor_parallel_size=2: they receive the
same prompts (3D_ALL_MICRO_DP with a generation mesh of one replica), generate in lockstep and
vLLM shards the full tensors each rank loads.  Model: an untied Llama (no q/k/v biases).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_hybrid import LOGPROB_ATOL, hf_generate, masked_max_diff

from hf_core.batch import Batch
from hf_core.runtime import WorkerGroup
from hf_testing.prompts import prompt_batch

pytestmark = pytest.mark.usefixtures("ray_cluster")

MODEL = "llama"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def group(models: dict[str, Path]) -> Iterator[WorkerGroup]:
    from vllm_test_workers import hybrid_group

    actor = {"lr": 1e-2, "eps": 1e-6, "micro_batch_size": 8}
    with hybrid_group("vllm_tp2", models[MODEL], actor, {"tensor_parallel_size": 2}) as workers:
        yield workers


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> Batch:
    return prompt_batch(models[MODEL], 32)


def test_two_ranks_form_one_tp2_engine(group: WorkerGroup, report: Any) -> None:
    info = group.info  # type: ignore[attr-defined]
    assert [i["layout"] for i in info] == [(0, 1, 0, 2), (0, 1, 1, 2)]
    assert all(i["executor"] == "external_launcher" for i in info)
    # Private shared-memory names, unlinked once joined: a killed earlier engine on this host
    # (the t_g=1 group of test_vllm_hybrid) cannot make this one fail with errno 17.
    assert all(i["shm_left"] == [] for i in info)
    report("t_g=2 vLLM start-up s per rank", [round(i["startup_seconds"], 1) for i in info])


def test_tp2_greedy_matches_hf_generate(group: WorkerGroup, prompts: Batch, models: dict) -> None:
    out = group.generate_micro_dp(prompts, params={"temperature": 0.0, "max_new_tokens": 12})
    assert len(out) == len(prompts)  # one replica: collected once, from TP rank 0
    expected = hf_generate(models[MODEL], prompts, NEW_TOKENS)
    width = expected.shape[1]
    mask = out["response_mask"][:, :width].bool()
    assert torch.equal(out["responses"][:, :width][mask], expected[mask])
    assert len({tuple(row) for row in out["responses"].tolist()}) > 24


def test_tp2_engine_loads_tp_slices_and_reports_memory_bytes(group: WorkerGroup) -> None:
    assert group.slice_layout() == [(True, 1, 2)] * 2  # LoadsTPSlices, GenerationLayout(1, 2)
    released, resumed = zip(*group.memory_bytes(), strict=True)
    # On the CPU both are no-ops that report what they would move: this rank's shard of the
    # weights plus its KV cache (VLLM_CPU_KVCACHE_SPACE=1 GiB).
    assert all(n > 1 << 30 for n in released) and released == resumed


def test_tp2_megatron_slices_restore_generation_after_a_perturbed_sync(
    group: WorkerGroup, prompts: Batch, models: dict[str, Path], report: Any
) -> None:
    """Perturbed whole tensors first, then each rank only its own megatron TP slices of the
    original weights (vocabulary padded to 64 like vLLM: divisible_by 32 x tp 2): greedy
    generation is HF's again, so every slice landed in its own rank's shard."""
    path = str(models[MODEL])
    stats = group.sync_folder_slices(path, 32 * 1024, perturb=0.5, divisible_by=32)
    assert all("error" not in s for s in stats), stats
    report(
        "t_g=2 slice sync buckets / s per rank",
        [(s["weight_sync/buckets"], round(s["weight_sync/seconds"], 2)) for s in stats],
    )
    out = group.generate_micro_dp(prompts, params={"temperature": 0.0, "max_new_tokens": 12})
    expected = hf_generate(models[MODEL], prompts, NEW_TOKENS)
    width = expected.shape[1]
    mask = out["response_mask"][:, :width].bool()
    assert torch.equal(out["responses"][:, :width][mask], expected[mask])


def test_tp2_slices_of_another_vocabulary_padding_are_refused(
    group: WorkerGroup, models: dict[str, Path]
) -> None:
    """megatron's default padding (a multiple of 128 x tp = 256 rows for 128 tokens) puts all
    128 rows on rank 0 -- the whole tensor, which rank 0 may load -- and none on rank 1, where
    vLLM expects rows [64, 128): a clear error naming both ranges and the fix, no gather."""
    path = str(models[MODEL])
    stats = group.sync_folder_slices(path, 32 * 1024, perturb=0.5, divisible_by=128)
    assert "error" not in stats[0], stats[0]
    error = stats[1]["error"]
    assert error.startswith("lm_head.weight: TP slice dim 0 [128, 128)"), error
    assert "dim 0 [64, 128)" in error and "make_vocab_size_divisible_by" in error


def test_tp2_log_probs_match_training_engine_after_update_and_sync(
    group: WorkerGroup, prompts: Batch, report: Any
) -> None:
    params = {"temperature": 0.8, "max_new_tokens": NEW_TOKENS, "seed": 5}
    batch = group.generate_micro_dp(prompts, params={**params, "temperature": 1.0})
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator())
    group.train(batch)
    stats = group.sync(bucket_bytes=32 * 1024)
    assert stats[0]["weight_sync/buckets"] > 3
    sampled = group.generate_micro_dp(prompts, params=params)
    trainer = group.log_probs(sampled, temperature=0.8)
    diff = masked_max_diff(
        sampled["rollout_log_probs"], trainer["log_probs"], sampled["response_mask"]
    )
    report("t_g=2 max |vLLM - FSDP| log-prob after update + sync, T=0.8", diff)
    assert diff < LOGPROB_ATOL


def test_tp2_ranks_given_different_prompts_fail_fast(group: WorkerGroup, prompts: Batch) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 4}
    errors = group.generate_per_rank([prompts.index([0, 1]), prompts.index([2, 3])], [params] * 2)
    assert all("different prompts" in error for error in errors), errors
    same = group.generate_per_rank([prompts.index([0, 1])] * 2, [params] * 2)
    assert same == ["", ""]  # the engine is still usable
