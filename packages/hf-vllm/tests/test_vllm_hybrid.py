"""The vLLM engine in hybrid mode on two data-parallel ranks (Ray workers, gloo, t_g = 1).

Each rank holds an FSDP actor, a vLLM engine (one replica per rank, external_launcher) and the
transformers engine, all on the same tiny tied Qwen2.  References are plain transformers in the
test process (``generate``) and the FSDP training engine (log-probs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_core.batch import Batch
from hf_core.runtime import WorkerGroup
from hf_testing.prompts import prompt_batch

pytestmark = pytest.mark.usefixtures("ray_cluster")

MODEL = "qwen2_tied"
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
# Float32 everywhere.  vLLM and the trainer compute the same function with different kernels
# (vLLM's fused qkv / gate_up GEMMs, its CPU paged-attention kernel and RMSNorm vs HF's eager
# modules), so logits differ only by the rounding of differently ordered sums: ~1e-6 relative
# to logits of magnitude ~10 (initializer_range 0.2), scaled by 1/T.  Observed worst case is
# ~2e-5; 1e-4 leaves 5x margin, while any real mismatch (temperature not applied: ~0.1-1,
# stale or half-loaded weights, a position off by one) is orders of magnitude larger.
LOGPROB_ATOL = 1e-4
ACTOR = {"lr": 1e-2, "eps": 1e-6, "micro_batch_size": 8, "grad_clip": 1.0}


@pytest.fixture(scope="module")
def group(models: dict[str, Path]) -> Iterator[WorkerGroup]:
    from vllm_test_workers import hybrid_group

    with hybrid_group("vllm_dp2", models[MODEL], ACTOR, {}, transformers=True) as workers:
        yield workers


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> Batch:
    return prompt_batch(models[MODEL], 48)


def hf_generate(path: Path, prompts: Batch, new_tokens: int) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[:, prompts["input_ids"].shape[1] :]


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def test_engine_builds_inside_the_training_group(group: WorkerGroup, report: Any) -> None:
    info = group.info  # type: ignore[attr-defined]
    assert [i["layout"] for i in info] == [(0, 2, 0, 1), (1, 2, 0, 1)]  # 2 replicas, t_g = 1
    for rank in info:
        assert rank["executor"] == "external_launcher"
        assert rank["torch_rng_kept"] and rank["numpy_rng_kept"] and rank["python_rng_kept"]
        assert rank["threads_kept"] and rank["threads_settable"]
        assert rank["shm_left"] == []  # vLLM's CPU shared-memory names were unlinked
    report("t_g=1 vLLM start-up s per rank", [round(i["startup_seconds"], 1) for i in info])


def test_greedy_matches_hf_generate(group: WorkerGroup, prompts: Batch, models: dict) -> None:
    out = group.generate(prompts, rollout="vllm", params=GREEDY)
    expected = hf_generate(models[MODEL], prompts, NEW_TOKENS)
    width = expected.shape[1]
    mask = out["response_mask"].bool()
    assert len(out) == len(prompts) == 48
    assert torch.equal(out["responses"][:, :width][mask[:, :width]], expected[mask[:, :width]])
    assert not mask[:, width:].any()  # HF stopped every row by then: so did vLLM
    # The tiny model must give different outputs for different prompts, or parity means little.
    assert len({tuple(row) for row in out["responses"].tolist()}) > 40


def test_batch_matches_transformers_rollout_engine(group: WorkerGroup, prompts: Batch) -> None:
    """Same keys, shapes, dtypes, padding and masks as the reference rollout engine."""
    params = {**GREEDY, "stop_token_ids": [5, 17]}
    ours = group.generate(prompts, rollout="vllm", params=params)
    ref = group.generate(prompts, rollout="transformers", params=params)
    assert sorted(ours.keys()) == sorted(ref.keys())
    for key in ref.keys():
        assert ours[key].shape == ref[key].shape, key
        assert ours[key].dtype == ref[key].dtype, key
        if key != "rollout_log_probs":
            assert torch.equal(ours[key], ref[key]), key
    assert (ours["response_mask"].sum(1) < NEW_TOKENS).sum() > 5  # stop tokens were hit
    mask = ref["response_mask"]
    diff = masked_max_diff(ours["rollout_log_probs"], ref["rollout_log_probs"], mask)
    assert diff < LOGPROB_ATOL
    assert float(ref["rollout_log_probs"].abs().max()) > 0.5  # nonzero log-probs compared


def test_sampling_seed_n_and_temperature(group: WorkerGroup, prompts: Batch) -> None:
    few = prompts.index(list(range(8)))
    params = {"temperature": 1.0, "max_new_tokens": 12, "n": 3, "seed": 7}
    first = group.generate(few, rollout="vllm", params=params)
    again = group.generate(few, rollout="vllm", params=params)
    other = group.generate(few, rollout="vllm", params={**params, "seed": 8})
    assert len(first) == 24 and torch.equal(first["prompts"][0], first["prompts"][2])
    assert torch.equal(first["responses"], again["responses"])  # a seed reproduces
    assert not torch.equal(first["responses"], other["responses"])
    samples = first["responses"].view(8, 3, -1)
    assert any(not torch.equal(s[0], s[1]) for s in samples)  # the n samples differ
    assert first.meta["temperature"] == 1.0 and not first.meta["rollout_log_probs_truncated"]
    top_k = group.generate(few, rollout="vllm", params={**params, "top_k": 5})
    assert top_k.meta["rollout_log_probs_truncated"]


def _train_batch(group: WorkerGroup, prompts: Batch) -> Batch:
    """A rollout from vLLM itself with random advantages: what an RL step trains on."""
    batch = group.generate(prompts, rollout="vllm", params={"max_new_tokens": NEW_TOKENS})
    gen = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=gen)
    return batch


def test_log_probs_match_training_engine_after_update_and_sync(
    group: WorkerGroup, prompts: Batch, report: Any
) -> None:
    sampled_params = {"temperature": 0.8, "max_new_tokens": NEW_TOKENS, "seed": 3}
    before = group.generate(prompts, rollout="vllm", params=sampled_params)
    greedy_before = group.generate(prompts, rollout="vllm", params=GREEDY)
    group.train(_train_batch(group, prompts))
    stats = group.sync(bucket_bytes=16 * 1024)  # many buckets: fused layers straddle them
    assert stats[0]["weight_sync/buckets"] > 5
    assert stats[0]["weight_sync/reload_calls"] > 1
    assert stats[0]["weight_sync/seconds"] > 0
    report("t_g=1 weight sync s (16 KiB buckets)", stats[0]["weight_sync/seconds"])

    after = group.generate(prompts, rollout="vllm", params=sampled_params)
    greedy = group.generate(prompts, rollout="vllm", params=GREEDY)
    assert not torch.equal(greedy["responses"], greedy_before["responses"])  # sync did something

    worst = {}
    for name, batch, temperature in (("T=0.8", after, 0.8), ("greedy", greedy, 0.0)):
        trainer = group.log_probs(batch, temperature=temperature)
        mask = batch["response_mask"]
        worst[name] = masked_max_diff(batch["rollout_log_probs"], trainer["log_probs"], mask)
    # The same sequences under the pre-update weights differ by far more than the tolerance.
    stale = group.log_probs(before, temperature=0.8)["log_probs"]
    moved = masked_max_diff(before["rollout_log_probs"], stale, before["response_mask"])
    for name, value in worst.items():
        report(f"t_g=1 max |vLLM - FSDP| log-prob after update + sync, {name}", value)
    report("t_g=1 same sequences, pre-update vLLM vs updated FSDP (must be large)", moved)
    assert max(worst.values()) < LOGPROB_ATOL
    assert moved > 100 * LOGPROB_ATOL


def test_perturbed_sync_changes_generation_and_restore_is_exact(
    group: WorkerGroup, prompts: Batch
) -> None:
    base = group.generate(prompts, rollout="vllm", params=GREEDY)
    group.sync(bucket_bytes=64 * 1024, perturb=0.05)
    perturbed = group.generate(prompts, rollout="vllm", params=GREEDY)
    group.sync(bucket_bytes=64 * 1024)
    restored = group.generate(prompts, rollout="vllm", params=GREEDY)
    changed = (perturbed["responses"] != base["responses"]).any(1).sum()
    assert changed > len(prompts) // 2
    assert torch.equal(restored["responses"], base["responses"])
    assert torch.equal(restored["rollout_log_probs"], base["rollout_log_probs"])


def test_half_sent_fused_layer_is_refused_and_loads_nothing(
    group: WorkerGroup, prompts: Batch
) -> None:
    group.sync(bucket_bytes=1 << 20, perturb=0.05)  # the engine now differs from the actor
    perturbed = group.generate(prompts, rollout="vllm", params=GREEDY)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    errors = group.sync_only(names)
    for error in errors:
        assert "model.layers.0.self_attn.qkv_proj" in error
        assert "model.layers.0.self_attn.k_proj.weight" in error
        assert "model.layers.1.mlp.gate_proj.weight" in error
    after = group.generate(prompts, rollout="vllm", params=GREEDY)
    assert torch.equal(after["responses"], perturbed["responses"])  # nothing half-loaded

    # A complete sync afterwards works: vLLM and the transformers engine, both synced, agree again.
    group.sync(bucket_bytes=1 << 20)
    group.sync(bucket_bytes=1 << 20, rollout="transformers")
    ours = group.generate(prompts, rollout="vllm", params=GREEDY)
    assert torch.equal(
        ours["responses"],
        group.generate(prompts, rollout="transformers", params=GREEDY)["responses"],
    )
    assert not torch.equal(ours["responses"], perturbed["responses"])


def test_release_hands_back_the_cpu_kv_cache_and_generation_is_unchanged(
    group: WorkerGroup, prompts: Batch
) -> None:
    """On the CPU the weights stay (sleep mode is CUDA's), but the KV cache's pages go back
    to the kernel during training: the process shrinks, and sampling after it is the same."""
    few = prompts.index(list(range(6)))
    params = {"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 11}
    before = group.generate(few, rollout="vllm", params=params)
    for released, resumed, freed, fall in group.memory_calls():
        assert not released and not resumed
        assert freed >= 2**28  # the KV cache (1 GiB here, VLLM_CPU_KVCACHE_SPACE=1)
        assert fall >= freed // 2, (fall, freed)
    after = group.generate(few, rollout="vllm", params=params)
    assert torch.equal(before["responses"], after["responses"])
    assert torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])
