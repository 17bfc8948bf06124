"""The FSDP engine on two data-parallel ranks (Ray workers, gloo) against single-process HF.

References are computed here, in plain transformers, independently of hf_fsdp's own code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from hf_core.batch import Batch
from hf_core.runtime import ResourcePool, WorkerGroup, spawn
from hf_testing.workers import (
    LOSSES,
    policy_loss,
    resumed_runs,
    rollout_batch,
    with_teacher_top_k,
)

pytestmark = pytest.mark.usefixtures("ray_cluster")

ATOL = 1e-5
B, P, R = 8, 6, 7  # global batch, prompt and response lengths


@pytest.fixture(scope="module")
def group(ray_cluster: None) -> Iterator[WorkerGroup]:
    from fsdp_test_workers import EngineWorker

    pool = ResourcePool([2], name="fsdp_dp2")
    workers = spawn(pool, {"engines": EngineWorker})["engines"]
    yield workers
    workers.shutdown()
    pool.release()


def _vocab(path: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def _inputs(batch: Batch) -> dict[str, torch.Tensor]:
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "position_ids": batch["position_ids"],
    }


def reference_log_probs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    logits = model(**_inputs(batch)).logits / temperature  # [B, P+R, V]
    shifted = logits[:, P - 1 : -1]  # token t of the response is predicted at P-1+t
    return torch.log_softmax(shifted, -1).gather(-1, batch["responses"][..., None])[..., 0]


def _masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


# ------------------------------------------------------------------------- forwards


# float32 logits of 3 tokens of the tiny vocabulary (128) at a time: the chunked head path
# (hf_core.algorithms.chunked_head), with a remainder chunk
CHUNKED_HEAD = {"logits_budget_bytes": 3 * 4 * 128}


@pytest.mark.parametrize("head", [{}, CHUNKED_HEAD], ids=["full-logits", "chunked-head"])
@pytest.mark.parametrize("folder", ["qwen2_tied", "llama"])
def test_log_probs_match_single_process(
    group: WorkerGroup, models: dict, folder: str, head: dict
) -> None:
    path = models[folder]
    group.build(f"ref_{folder}", {"model_path": str(path), "trainable": False, **head})
    batch = rollout_batch(B, P, R, _vocab(path), seed=11)
    out = group.log_probs(batch, name=f"ref_{folder}", temperature=0.7)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        expected = reference_log_probs(model, batch, 0.7)
        logits = model(**_inputs(batch)).logits[:, P - 1 : -1] / 0.7
        entropy = torch.distributions.Categorical(logits=logits).entropy()
    mask = batch["response_mask"]
    assert out["log_probs"].shape == (B, R)
    assert _masked_max_diff(out["log_probs"], expected, mask) < ATOL
    assert _masked_max_diff(out["entropy"], entropy, mask) < ATOL
    with pytest.raises(Exception, match="frozen engine"):
        group.train(batch, name=f"ref_{folder}", loss="policy")
    group.drop(f"ref_{folder}")


def _frozen_head(group: WorkerGroup, path: Path, head: str, method: str, seed: int) -> tuple:
    """Two ranks' ``method`` outputs of a frozen ``head`` engine, the batch, and the HF model's
    logits on the whole batch in one process."""
    auto = {"value": AutoModelForTokenClassification, "score": AutoModelForSequenceClassification}
    group.build(head, {"model_path": str(path), "head": head, "trainable": False})
    batch = rollout_batch(B, P, R, _vocab(path), seed=seed)
    out = getattr(group, method)(batch, name=head)
    group.drop(head)
    with torch.no_grad():
        logits = auto[head].from_pretrained(path).eval()(**_inputs(batch)).logits
    return out, batch, logits


def test_values_match_single_process(group: WorkerGroup, models: dict) -> None:
    out, batch, logits = _frozen_head(group, models["value"], "value", "values", seed=12)
    expected = logits[..., 0][:, P - 1 : -1]
    assert out["values"].shape == (B, R)
    assert _masked_max_diff(out["values"], expected, batch["response_mask"]) < ATOL


def test_scores_match_single_process(group: WorkerGroup, models: dict) -> None:
    out, _, logits = _frozen_head(group, models["score"], "score", "scores", seed=13)
    expected = logits[
        :, 0
    ]  # transformers reads the score at the last non-pad token: the same one here
    assert out["scores"].shape == (B,)
    assert float((out["scores"] - expected).abs().max()) < ATOL
    assert float(expected.std()) > 1e-3  # scores differ across sequences: the token read matters


# --------------------------------------------------------------------------- updates

# eps=1e-5: Adam divides by |g| + eps, so entries whose gradient is ~0 by symmetry (k_proj:
# softmax ignores a shift shared by all keys) turn float32 summation-order noise into updates
# of lr * noise / eps, whatever the engine does: ~lr-sized with the default 1e-8, and above
# ATOL with 1e-6 on an AVX2-only CPU (noise ~1.1e-8 there).  Any real gradient (>> 1e-5) still
# moves its weight by ~lr, 100x ATOL.
TRAIN = {"lr": 1e-3, "eps": 1e-5, "micro_batch_size": 2, "grad_clip": 0.5, "weight_decay": 0.01}


def _reference_step(model: torch.nn.Module, loss: torch.Tensor) -> float:
    opt = torch.optim.AdamW(
        model.parameters(), lr=TRAIN["lr"], eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"]
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
    opt.step()
    return float(norm)


def _assert_same_weights(got: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert set(got) <= set(expected)
    assert {k for k in expected if k not in got} <= {"lm_head.weight"}  # tied: exported once
    diffs = {k: float((got[k] - expected[k]).abs().max()) for k in got}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < ATOL, (worst, diffs[worst])


FSDP = {"cpu_data_parallel": "fsdp"}  # the default (auto) too: FSDP2 shards
REPLICATE = {"cpu_data_parallel": "replicate"}  # hf_fsdp.data_parallel.cpu_replicas
LEADER = {"cpu_data_parallel": "leader"}  # hf_fsdp.data_parallel.cpu_leader
STRATEGY = {"fsdp": "fsdp2", "replicate": "cpu_replicas", "leader": "cpu_leader"}
"""cpu_data_parallel -> the strategy two CPU ranks of one host run (auto: FSDP2)"""
MICRO_BATCHING = {
    "fixed-chunks": {"max_tokens_per_micro_batch": None},
    "token-budget": {},  # the default budget, samples capped by TRAIN's micro_batch_size
    # ~2 sequences per micro-batch, ranks get different counts: the short rank pads passes
    "small-token-budget": {"micro_batch_size": None, "max_tokens_per_micro_batch": 2 * (P + R)},
    "replicas": REPLICATE,
    "leader": LEADER,
    "leader-small-token-budget": {**LEADER, "micro_batch_size": None,
                                  "max_tokens_per_micro_batch": 2 * (P + R)},
    "leader-chunked-head": {**LEADER, **CHUNKED_HEAD},
    "replicas-small-token-budget": {**REPLICATE, "micro_batch_size": None,
                                    "max_tokens_per_micro_batch": 2 * (P + R)},
    "per-layer-units": {**FSDP, "fsdp_unit": "layer"},  # tiny models default to one unit
    # log-probs from the hidden states in token chunks; with one FSDP unit, the root's
    # gradients are reduced only if the head's output still reaches FSDP's backward hooks
    "chunked-head": CHUNKED_HEAD,
    "replicas-chunked-head": {**REPLICATE, **CHUNKED_HEAD},
    "chunked-head-per-layer": {**FSDP, **CHUNKED_HEAD, "fsdp_unit": "layer"},
    # recomputed activations (what gradient_checkpointing: auto turns on at real sizes)
    "gradient-checkpointing": {**FSDP, "gradient_checkpointing": True, "fsdp_unit": "layer"},
    # FSDP's collectives on gloo instead of the default shared-memory copies
    "process-group-collectives": {"cpu_collectives": "process_group", "fsdp_unit": "layer"},
}  # fmt: skip


@pytest.mark.parametrize("micro_batching", MICRO_BATCHING.values(), ids=MICRO_BATCHING.keys())
def test_actor_update_matches_single_process(
    group: WorkerGroup, models: dict, micro_batching: dict
) -> None:
    path = models["qwen2_tied"]
    built = group.build("actor", {"model_path": str(path), **TRAIN, **micro_batching})
    expected_collectives = micro_batching.get("cpu_collectives", "shared_memory")
    assert [b["collectives"] for b in built] == [expected_collectives] * 2
    strategy = STRATEGY[micro_batching.get("cpu_data_parallel", "fsdp")]
    assert [b["strategy"] for b in built] == [strategy] * 2
    before = group.weights("actor")[0]
    batch = rollout_batch(B, P, R, _vocab(path), seed=21)
    metrics = group.train(batch, name="actor", loss="policy")
    got = group.weights("actor")[0]
    model, loss_value, norm = _single_process_update(path, batch)

    assert len(metrics) == 2 and metrics[0] == metrics[1]  # every rank reports global values
    assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > TRAIN["grad_clip"]  # the clip was active, so it was tested
    assert metrics[0]["loss"] == pytest.approx(loss_value, rel=1e-5, abs=1e-6)
    assert metrics[0]["lr"] == TRAIN["lr"] and metrics[0]["step"] == 1.0
    assert metrics[0][f"data_parallel/{strategy}"] == 1.0
    moved = max(float((got[k] - before[k]).abs().max()) for k in got)
    assert moved > 100 * ATOL  # the step changed the weights by far more than the tolerance
    _assert_same_weights(got, model)
    if strategy != "fsdp2":  # one shared model, or replicas that took the same averaged step
        digests = group.local_digest("actor")
        assert digests[0] == digests[1]
    group.drop("actor")


def _single_process_update(path: Path, batch: Batch) -> tuple[torch.nn.Module, float, float]:
    """The policy update of ``batch`` by plain transformers in this process: the model after
    it, the loss and the gradient norm."""
    model = AutoModelForCausalLM.from_pretrained(path)
    one = Batch(dict(batch.tensors.items()))
    one.meta.update(dp_size=1, global_response_tokens=int(batch["response_mask"].sum()))
    log_probs = reference_log_probs(model, batch, 1.0)
    logits = model(**_inputs(batch)).logits[:, P - 1 : -1]
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    loss, _ = policy_loss({"log_probs": log_probs, "entropy": entropy}, one)
    loss_value = loss.item()
    return model, loss_value, _reference_step(model, loss)


def test_leader_training_of_batches_of_different_widths_matches_single_process(
    group: WorkerGroup, models: dict
) -> None:
    """Leader training joins the ranks' batches when they have one width; otherwise it runs
    each rank's share as that rank would and averages (this path)."""
    path = models["qwen2_tied"]
    built = group.build("actor_widths", {"model_path": str(path), **TRAIN, **LEADER})
    assert [b["strategy"] for b in built] == ["cpu_leader"] * 2
    batch = rollout_batch(B, P, R, _vocab(path), seed=25)
    metrics = group.train_widened(batch, name="actor_widths", loss="policy")
    got = group.weights("actor_widths")[0]
    model, loss_value, norm = _single_process_update(path, batch)
    assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics[0]["loss"] == pytest.approx(loss_value, rel=1e-5, abs=1e-6)
    _assert_same_weights(got, model)
    group.drop("actor_widths")


@pytest.mark.parametrize("data_parallel", ["leader", "replicate", "fsdp"])
def test_update_budget_is_what_the_ranks_grow_into(
    group: WorkerGroup, models: dict, data_parallel: str
) -> None:
    """The automatic micro-batch budget: ranks that update side by side (replicas, FSDP)
    split the node's free memory; under the leader, the host's first rank updates alone
    while the others wait, so it may grow into all of it (a rank's share turned recomputation
    on at the 0.5B shape)."""
    path = models["qwen2_tied"]
    name = f"actor_budget_{data_parallel}"
    group.build(name, {"model_path": str(path), **TRAIN, "cpu_data_parallel": data_parallel})
    batch = rollout_batch(B, P, R, _vocab(path), seed=27)
    free = 12 * 1024**3
    rows = group.train_with_free_memory(batch, name=name, loss="policy", free_bytes=free)
    assert len(rows) == 2 and rows[0]["share"] < rows[0]["alone"]  # two ranks on this node
    expected = "alone" if data_parallel == "leader" else "share"
    assert [row["chosen"] for row in rows] == [rows[0][expected]] * 2
    group.drop(name)


VALUE_AND_SCORE = {  # head: (model, its HF class, the loss's inputs from the HF logits)
    "value": (
        "value",
        AutoModelForTokenClassification,
        lambda logits: {"values": logits[..., 0][:, P - 1 : -1]},
    ),
    # the last real token: transformers reads the score there too
    "score": ("score", AutoModelForSequenceClassification, lambda logits: {"scores": logits[:, 0]}),
}


@pytest.mark.parametrize(
    ("head", "unit"),
    [("value", "auto"), ("score", "auto"), ("score", "layer")],
    ids=["critic", "score-one-unit", "score-per-layer-units"],
)
def test_value_and_score_updates_match_single_process(
    group: WorkerGroup, models: dict, head: str, unit: str
) -> None:
    """A critic's and a score model's update on two ranks (FSDP2) against transformers.  A
    score head's loss reads the head's per-token output captured inside the forward: it must
    still reach FSDP's backward hooks (on the model's outputs), or with the whole model as
    one unit the gradients are never reduced over the ranks."""
    folder, auto, loss_inputs = VALUE_AND_SCORE[head]
    path = models[folder]
    group.build(head, {"model_path": str(path), "head": head, **TRAIN, "fsdp_unit": unit})
    batch = rollout_batch(B, P, R, _vocab(path), seed=22)
    metrics = group.train(batch, name=head, loss=head)
    got = group.weights(head)[0]

    model = auto.from_pretrained(path)
    one = Batch(dict(batch.tensors.items()))
    one.meta.update(dp_size=1, global_batch_size=B)
    loss, _ = LOSSES[head](loss_inputs(model(**_inputs(batch)).logits), one)
    norm = _reference_step(model, loss)
    assert metrics[0]["data_parallel/fsdp2"] == 1.0
    assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    _assert_same_weights(got, model)
    group.drop(head)


# --------------------------------------------------------------- weight sync, rollout


GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


def _text_prompts(path: Path) -> tuple[Any, Any, Batch]:
    """Eight left-padded text prompts: the tokenizer, its encoding, and as a batch."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    texts = ["reverse 1234:", "12+7=", "hello", "abc def", "9", "reverse 55:", "x+y=", "ok!"]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    batch = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return tokenizer, enc, batch


def _assert_decodes_as_exported(
    group: WorkerGroup, name: str, decoded: Batch, path: Path, folder: Path
) -> None:
    """``decoded`` (greedy, from the synced rollout engine) is what transformers generates
    from the engine's exported HF folder."""
    exported = group.export_hf(name, str(folder), tokenizer=str(path))[0]
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert len(AutoTokenizer.from_pretrained(exported)) == model.config.vocab_size
    tokenizer, enc, _ = _text_prompts(path)
    with torch.no_grad():
        expected = model.generate(
            **enc, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id
        )[:, enc["input_ids"].shape[1] :]
    got = decoded["responses"][:, : expected.shape[1]]
    mask = decoded["response_mask"][:, : expected.shape[1]].bool()
    assert torch.equal(got[mask], expected[mask])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top-2): fused expert parameters sharded over the ranks'
    experts, sent per expert (hf_fsdp.fused_experts)."""
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=5)


@pytest.mark.parametrize("folder", ["qwen2_tied", "qwen3_moe"])
def test_weight_sync_then_rollout_matches_exported_model(
    group: WorkerGroup, models: dict, moe_model: Path, folder: str, tmp_path: Path
) -> None:
    path = moe_model if folder == "qwen3_moe" else models[folder]
    group.build("actor_sync", {"model_path": str(path), **TRAIN, "lr": 1e-2})
    group.train(rollout_batch(B, P, R, _vocab(path), seed=23), name="actor_sync", loss="policy")
    _, _, prompts = _text_prompts(path)

    group.build_rollout("rollout", {"model_path": str(path), "dtype": "float32"})
    before = group.generate(prompts, rollout="rollout", params=GREEDY)
    stats = group.sync("actor_sync", rollout="rollout", bucket_bytes=8 * 1024)
    after = group.generate(prompts, rollout="rollout", params=GREEDY)
    assert stats[0]["buckets"] > 3 and stats[0] == stats[1]
    _assert_decodes_as_exported(group, "actor_sync", after, path, tmp_path / "actor_hf")
    assert not torch.equal(before["responses"], after["responses"])  # the sync did something

    # Sampled tokens' log-probs agree with the trainer's recomputation at that temperature.
    sampled = group.generate(
        prompts, rollout="rollout", params={"temperature": 0.8, "max_new_tokens": 10, "seed": 4}
    )
    recomputed = group.log_probs(sampled, name="actor_sync", temperature=0.8)
    mask = sampled["response_mask"]
    assert _masked_max_diff(recomputed["log_probs"], sampled["rollout_log_probs"], mask) < 1e-4
    group.drop("actor_sync")
    group.drop("rollout")


def test_leader_ranks_sync_as_any_engine_then_decode_as_the_trained_model(
    group: WorkerGroup, models: dict, tmp_path: Path
) -> None:
    """Leader training with leader decoding (both CPU-only, asked for): core's standard
    sync, every rank exporting its weights (the others read the first rank's mirror) into
    its rollout engine, after which the leader decodes as the trained model does."""
    path = models["qwen2_tied"]
    group.build("actor_leader", {"model_path": str(path), **LEADER, **TRAIN, "lr": 1e-2})
    group.train(rollout_batch(B, P, R, _vocab(path), seed=23), name="actor_leader", loss="policy")
    _, _, prompts = _text_prompts(path)
    rollout = {"model_path": str(path), "dtype": "float32", "cpu_leader_generation": True}
    group.build_rollout("rollout_leader", rollout)
    before = group.generate(prompts, rollout="rollout_leader", params=GREEDY)
    loaded = group.hybrid_sync("actor_leader", rollout="rollout_leader", bucket_bytes=8 * 1024)
    assert loaded[0] > 0 and loaded == [loaded[0]] * 2  # every rank loaded every weight
    after = group.generate(prompts, rollout="rollout_leader", params=GREEDY)
    assert not torch.equal(before["responses"], after["responses"])  # the sync did something
    _assert_decodes_as_exported(group, "actor_leader", after, path, tmp_path / "leader_export")
    group.drop("actor_leader")
    group.drop("rollout_leader")


# --------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("data_parallel", ["leader", "replicate", "fsdp"])
def test_resume_from_checkpoint_is_identical(
    group: WorkerGroup, models: dict, tmp_path: Path, data_parallel: str
) -> None:
    path = models["llama"]
    config = {
        "model_path": str(path),
        **TRAIN,
        "cpu_data_parallel": data_parallel,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "total_steps": 6,
    }
    first, second = (rollout_batch(B, P, R, _vocab(path), seed=s) for s in (31, 32))
    run_a, run_b, steps = resumed_runs(group, config, first, second, str(tmp_path / "ckpt"))

    assert steps == [1, 1]
    assert run_a.rand == run_b.rand  # each rank's RNG restored
    assert run_a.metrics == run_b.metrics  # same lr (scheduler restored), loss and grad norm
    assert run_a.metrics[0]["lr"] == TRAIN["lr"]  # step 2 of a 2-step warm-up
    for name, tensor in run_a.weights.items():
        assert torch.equal(tensor, run_b.weights[name]), name


@pytest.mark.parametrize("data_parallel", [{}, REPLICATE], ids=["default", "replicas"])
def test_vlm_update_on_images_of_different_sizes_matches_single_process(
    group: WorkerGroup, vlm: dict, data_parallel: dict
) -> None:
    """A vision-language policy step on two ranks, each holding images of other sizes, is the
    single-process step; the reference is transformers' own forward (its own 3-D positions)."""
    from transformers import AutoModelForImageTextToText

    from hf_core.engines.model_classes import checkpoint_names
    from hf_core.multimodal import MULTI_MODAL_KEY, ImageFeatures
    from hf_testing.visual_task import image_rollout_batch

    path = vlm["model"]
    group.build("vlm", {"model_path": str(path), **TRAIN, **data_parallel})
    batch = image_rollout_batch(path, vlm["train"], B, R, seed=31)
    grids = [tuple(f.image_grid_thw[0].tolist()) for f in batch[MULTI_MODAL_KEY]]
    assert set(grids[: B // 2]) != set(grids[B // 2 :])  # the ranks get different sizes
    metrics = group.train(batch, name="vlm", loss="policy")
    got = group.weights("vlm")[0]

    model = AutoModelForImageTextToText.from_pretrained(path)
    prompt = batch["prompts"].shape[1]
    features = ImageFeatures.concat(list(batch[MULTI_MODAL_KEY]))
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        pixel_values=features.pixel_values,
        image_grid_thw=features.image_grid_thw,
        mm_token_type_ids=(batch["input_ids"] == model.config.image_token_id).int(),
    ).logits[:, prompt - 1 : -1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    one = Batch(dict(batch.tensors.items()))
    one.meta.update(dp_size=1, global_response_tokens=int(batch["response_mask"].sum()))
    loss, _ = policy_loss({"log_probs": log_probs, "entropy": entropy}, one)
    norm = _reference_step(model, loss)

    assert metrics[0]["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    saved = checkpoint_names(model, dict(model.named_parameters()))
    expected = {saved[k]: v for k, v in model.named_parameters()}
    assert set(got) == set(expected), set(got) ^ set(expected)
    diffs = {k: float((got[k] - expected[k].detach()).abs().max()) for k in got}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < ATOL, (worst, diffs[worst])
    group.drop("vlm")


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (gathered from its shards under FSDP)."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


SEQUENCE_PARALLEL = {
    "packed": {},
    "padded-rows": {"sequence_packing": False},
    "fsdp-recomputed-chunked-head": {
        **FSDP,
        **CHUNKED_HEAD,
        "gradient_checkpointing": True,
        "fsdp_unit": "layer",
    },
}


HEADS = {  # head: (model, loss, the single-process forward)
    "lm": ("qwen2_tied", "policy", "compute_log_probs"),
    # top-k distillation: the teacher's top-k scored by the training forward, and the
    # engine's own top-k from compute_log_probs (a teacher's forward)
    "lm-top-k": ("qwen2_tied", "distill_top_k", "compute_log_probs"),
    "value": ("value", "value", "compute_values"),
    "score": ("score", "score", "compute_scores"),
}


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("settings", SEQUENCE_PARALLEL.values(), ids=SEQUENCE_PARALLEL.keys())
def test_sequence_parallel_pair_equals_one_rank(
    group: WorkerGroup, models: dict, settings: dict, head: str
) -> None:
    """Ulysses SP = 2 (both ranks hold the same samples and split their tokens) gives the
    outputs, loss, gradient norm and gradients of one rank running the whole batch."""
    from hf_fsdp.engine import FSDPEngine

    model, loss, method = HEADS[head]
    path = models[model]
    config = {"model_path": str(path), **TRAIN, "head": head.removesuffix("-top-k"), **settings}
    batch = rollout_batch(B, 12, 10, _vocab(path), seed=6)  # mixed lengths
    top_k = {}
    if head == "lm-top-k":
        batch = with_teacher_top_k(batch, _vocab(path), k=5, seed=7)
        batch.meta["top_k"] = top_k["top_k"] = 4
    group.build("sp", {**config, "sequence_parallel_size": 2})
    got = group.whole_batch_step(batch, name="sp", loss=loss)
    group.drop("sp")

    one = FSDPEngine(config)
    want = getattr(one, method)(batch, **top_k)
    grads: dict[str, torch.Tensor] = {}
    assert one.optimizer is not None
    one.optimizer.register_step_pre_hook(lambda *_: grads.update(_gradients(one.model)))
    metrics = one.train_step(batch, LOSSES[loss])

    for rank in (0, 1):  # both ranks of the group return the whole batch's outputs
        for key in want.keys():
            mask = batch["response_mask"].bool() if want[key].dim() >= 2 else slice(None)
            diff = (got[rank]["outputs"][key] - want[key])[mask].abs().max()
            assert float(diff) < ATOL, (rank, key, float(diff))
    step = got[0]["metrics"]
    assert step["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)
    assert step["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert grads and got[0]["grads"].keys() == grads.keys()
    worst = max(float((got[0]["grads"][k] - grads[k]).abs().max()) for k in grads)
    assert worst < ATOL, worst
    if head == "score":  # a score needs no response: nothing to count below
        return
    if settings.get("sequence_packing", True):
        # only each micro-batch's round-up to an even token count
        assert step["padding_tokens_sum"] <= B // TRAIN["micro_batch_size"]
    else:
        assert step["padding_tokens_sum"] > 0
