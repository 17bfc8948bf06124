"""The megatron engine on four Ray ranks (gloo) against single-process HF references.

One 4-rank worker group serves every test; each test builds its engines (re-initialising
megatron's process groups for its layout) and drops them.  Data goes through core's
``3D_PROTO`` (split over DP, collected from TP rank 0 of the last PP stage), so the meshes the
engine reports are exercised too.  References are plain transformers, independent of
hf_megatron's code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
)

from hf_core.batch import Batch
from hf_core.engines.top_k import (
    LOG_PROBS_AT_TEACHER_TOP_K,
    TEACHER_TOP_K_IDS,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
)
from hf_core.runtime import WorkerGroup
from hf_testing.conformance.reference import hf_log_probs_and_entropy, hf_top_k
from hf_testing.workers import (
    LOSSES,
    resumed_runs,
    rollout_batch,
    value_loss,
    with_teacher_top_k,
)

ATOL = 1e-5
B, P, R = 8, 6, 7  # global batch, prompt and response lengths
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
# eps=1e-4: Adam's first step moves each entry by lr * g / (|g| + eps).  Entries whose
# gradient is ~0 (k_proj by symmetry, a few norm entries: |g| ~ 1e-7 after clipping) would
# turn float32 summation-order noise -- TP and PP sum in another order than one process --
# into a sizeable fraction of lr with a smaller eps, whatever the engine does.
TRAIN = {"lr": 1e-3, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 0.5, "weight_decay": 0.01}


def _vocab(path: Path) -> int:
    return AutoConfig.from_pretrained(path).vocab_size


def _inputs(batch: Batch) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}


def _masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def _engine(path: Path, tp: int, pp: int, **extra: object) -> dict:
    return {
        "model_path": str(path),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        **extra,
    }


def _hf_reference_state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


# ---------------------------------------------------------------- weight round trip


@pytest.mark.parametrize("folder", ["qwen2_tied", "qwen2", "llama", "llama_tied", "odd_vocab"])
def test_hf_to_megatron_to_hf_is_exact(
    group: WorkerGroup, models: dict, folder: str, tmp_path: Path
) -> None:
    """Load the HF folder into TP=2 x PP=2, export it back: bit-identical tensors, both as
    streamed canonical weights and as a HF folder that ``from_pretrained`` loads."""
    path = models[folder]
    info = group.build("rt", _engine(path, 2, 2, trainable=False, make_vocab_size_divisible_by=1))
    assert sorted(i["coords"] for i in info) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    stage0 = next(i for i in info if i["coords"] == (0, 1, 0))["native"]
    last = next(i for i in info if i["coords"] == (1, 1, 0))["native"]
    assert "embedding.word_embeddings.weight" in stage0 and "output_layer.weight" not in stage0
    assert "decoder.final_layernorm.weight" in last
    got = group.weights("rt")[0]
    expected = _hf_reference_state(path)
    tied = AutoConfig.from_pretrained(path).tie_word_embeddings
    assert set(got) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    exported = Path(group.export_hf("rt", str(tmp_path / "hf"))[0])
    group.drop("rt")
    assert _hf_reference_state(exported).keys() == got.keys()
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.tie_word_embeddings == tied
    state = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


# ------------------------------------------------------------------------- forwards


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_match_single_process_hf(group: WorkerGroup, models: dict, layout: str) -> None:
    tp, pp = LAYOUTS[layout]
    folder = "odd_vocab" if layout == "tp2" else "qwen2_tied"
    path = models[folder]
    # odd_vocab under TP=2 with no extra padding multiple: the last rank holds a padded row.
    group.build("ref", _engine(path, tp, pp, trainable=False, make_vocab_size_divisible_by=1))
    batch = rollout_batch(B, P, R, _vocab(path), seed=11)
    out = group.log_probs(batch, name="ref", temperature=0.7, top_k=4)
    model = AutoModelForCausalLM.from_pretrained(path)
    expected, entropy = hf_log_probs_and_entropy(model, batch, 0.7)
    mask = batch["response_mask"]
    assert out["log_probs"].shape == (B, R)
    assert _masked_max_diff(out["log_probs"], expected, mask) < ATOL
    assert _masked_max_diff(out["entropy"], entropy, mask) < ATOL
    # a teacher's top-k (top-k distillation): the shards' top-k gathered, then the top-k
    top_log_probs, top_ids = hf_top_k(model, batch, 0.7, 4)
    real = mask.bool()
    assert torch.equal(out[TOP_K_IDS][real].long(), top_ids[real])
    assert float((out[TOP_K_LOG_PROBS][real] - top_log_probs[real]).abs().max()) < ATOL
    if pp > 1:  # every pipeline stage returns the last stage's outputs
        for each in group.log_probs_everywhere(batch, name="ref", temperature=0.7, top_k=4):
            assert _masked_max_diff(each["log_probs"], expected, mask) < ATOL
            assert torch.equal(each[TOP_K_IDS][real].long(), top_ids[real])
    with pytest.raises(Exception, match="frozen engine"):
        group.train(batch, name="ref", loss="policy")
    group.drop("ref")


def test_critic_values_under_tp2_pp2(group: WorkerGroup, models: dict) -> None:
    path = models["value"]
    group.build("critic", _engine(path, 2, 2, head="value", trainable=False))
    batch = rollout_batch(B, P, R, _vocab(path), seed=12)
    out = group.values(batch, name="critic")
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = model(**_inputs(batch)).logits[..., 0][:, P - 1 : -1]
    assert out["values"].shape == (B, R)
    assert _masked_max_diff(out["values"], expected, batch["response_mask"]) < ATOL
    assert float(expected.std()) > 1e-3
    group.drop("critic")


def test_critic_from_a_causal_lm_folder_seeds_its_head(group: WorkerGroup, models: dict) -> None:
    path = models["llama"]
    info = group.build("critic0", _engine(path, 2, 2, head="value", trainable=False, seed=3))
    for rank in info:  # the head lives on the last stage, seeded identically on both TP ranks
        last = rank["coords"][0] == 1
        assert rank["initialized"] == (["score.weight", "score.bias"] if last else [])
    batch = rollout_batch(B, P, R, _vocab(path), seed=14)
    values = group.values(batch, name="critic0")["values"]
    group.drop("critic0")
    assert values.shape == (B, R) and torch.isfinite(values).all()
    assert float(values.std()) > 1e-4


# --------------------------------------------------------------------------- updates


def _reference_update(
    path: Path, batch: Batch, loss_name: str = "policy"
) -> tuple[dict[str, torch.Tensor], float, float]:
    """One AdamW step of the HF model on the whole batch: weights, loss, grad norm."""
    model = AutoModelForCausalLM.from_pretrained(path)
    one = Batch(dict(batch.tensors.items()))
    one.meta.update(dp_size=1, global_response_tokens=int(batch["response_mask"].sum()))
    logits = model(**_inputs(batch)).logits[:, P - 1 : -1]
    every = torch.log_softmax(logits, -1)
    log_probs = every.gather(-1, batch["responses"][..., None])[..., 0]
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    outputs = {"log_probs": log_probs, "entropy": entropy}
    if TEACHER_TOP_K_IDS in batch:
        outputs[LOG_PROBS_AT_TEACHER_TOP_K] = every.gather(-1, batch[TEACHER_TOP_K_IDS].long())
    loss, _ = LOSSES[loss_name](outputs, one)
    opt = torch.optim.AdamW(
        model.parameters(), lr=TRAIN["lr"], eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"]
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
    opt.step()
    return model.state_dict(), float(loss), float(norm)


def _max_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple:
    diffs = {k: float((got[k] - expected[k]).abs().max()) for k in got}
    worst = max(diffs, key=diffs.get)
    return worst, diffs[worst]


@pytest.fixture(scope="module")
def update_reference(models: dict) -> dict:
    path = models["qwen2_tied"]
    batch = rollout_batch(B, P, R, _vocab(path), seed=21)
    weights, loss, norm = _reference_update(path, batch)
    return {"batch": batch, "weights": weights, "loss": loss, "norm": norm, "results": {}}


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "tp2pp2"])
def test_actor_update_matches_tp1_and_single_process(
    group: WorkerGroup, models: dict, update_reference: dict, layout: str
) -> None:
    """One policy update through megatron's schedules + distributed optimizer.

    tp1 runs DP=4, tp2 and pp2 DP=2, tp2pp2 DP=1: the loss-scaling contract must make all of
    them equal to one single-process step on the whole batch.
    """
    tp, pp = LAYOUTS.get(layout, (1, 1))
    path = models["qwen2_tied"]
    group.build("actor", _engine(path, tp, pp, **TRAIN))
    before = group.weights("actor")[0]
    metrics = group.train(update_reference["batch"], name="actor", loss="policy")
    got = group.weights("actor")[0]
    group.drop("actor")

    assert len(metrics) == 4 // (tp * pp)  # one report per DP replica (3D_PROTO collect)
    assert all(m == metrics[0] for m in metrics)  # every rank reports the global values
    m = metrics[0]
    assert m["grad_norm"] == pytest.approx(update_reference["norm"], rel=1e-5)
    assert update_reference["norm"] > TRAIN["grad_clip"]  # clipping was active
    assert m["loss"] == pytest.approx(update_reference["loss"], rel=1e-5, abs=1e-6)
    assert m["lr"] == TRAIN["lr"] and m["step"] == 1.0 and m["update_skipped"] == 0.0
    moved = max(float((got[k] - before[k]).abs().max()) for k in got)
    assert moved > 100 * ATOL
    worst, diff = _max_diff(got, update_reference["weights"])
    assert diff < ATOL, (worst, diff)
    update_reference["results"][layout] = got
    if layout != "tp1" and "tp1" in update_reference["results"]:
        worst, diff = _max_diff(got, update_reference["results"]["tp1"])
        assert diff < ATOL, (worst, diff)


def test_top_k_distillation_update_under_tp2_pp2_matches_single_process(
    group: WorkerGroup, models: dict
) -> None:
    """A teacher's top-k scored on the vocabulary shards (each rank's ids, reduced over TP)
    and the loss on the last stage: the update equals one single-process AdamW step."""
    path = models["qwen2_tied"]
    batch = with_teacher_top_k(rollout_batch(B, P, R, _vocab(path), seed=22), _vocab(path), 5, 3)
    weights, loss, norm = _reference_update(path, batch, "distill_top_k")
    group.build("actor", _engine(path, 2, 2, **TRAIN))
    metrics = group.train(batch, name="actor", loss="distill_top_k")[0]
    got = group.weights("actor")[0]
    group.drop("actor")
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    worst, diff = _max_diff(got, weights)
    assert diff < ATOL, (worst, diff)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_declared_state_bytes_match_what_the_engine_holds(
    group: WorkerGroup, models: dict, dtype: str
) -> None:
    """The pre-start memory check takes megatron's own count of a rank's weights, gradients
    and optimizer state (``state_bytes_per_rank``): TP=2 x DP=2 with the distributed
    optimizer, after a step (Adam's moments exist), against the storages the engine holds."""
    from hf_core.engines.hf_folder import read_model_config
    from hf_core.planner.models import from_hf_config
    from hf_megatron.config import MegatronEngineConfig

    path = models["qwen2_tied"]
    settings = _engine(path, 2, 1, **TRAIN, param_dtype=dtype)
    group.build("actor", settings)
    group.train(rollout_batch(B, P, R, _vocab(path), seed=23), name="actor", loss="policy")
    held = group.state_bytes("actor")
    group.drop("actor")

    params = from_hf_config(read_model_config(path)).num_params
    declared = MegatronEngineConfig(**settings).state_bytes_per_rank(params, 4, trainable=True)
    # padding (vocabulary to a multiple of 64 / TP, buckets for DP) is the only difference
    assert all(declared <= bytes_ <= 1.1 * declared for bytes_ in held), (held, declared)


def test_critic_update_under_tp2_pp2(group: WorkerGroup, models: dict) -> None:
    path = models["value"]
    group.build("critic", _engine(path, 2, 2, head="value", **TRAIN))
    batch = rollout_batch(B, P, R, _vocab(path), seed=22)
    metrics = group.train(batch, name="critic", loss="value")
    got = group.weights("critic")[0]
    group.drop("critic")

    model = AutoModelForTokenClassification.from_pretrained(path)
    one = Batch(dict(batch.tensors.items()))
    one.meta.update(dp_size=1, global_batch_size=B)
    values = model(**_inputs(batch)).logits[..., 0][:, P - 1 : -1]
    loss, _ = value_loss({"values": values}, one)
    opt = torch.optim.AdamW(
        model.parameters(), lr=TRAIN["lr"], eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"]
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
    opt.step()
    assert metrics[0]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    worst, diff = _max_diff(got, model.state_dict())
    assert diff < ATOL, (worst, diff)


# ---------------------------------------------------------------------- checkpoints


def test_resume_from_checkpoint_is_identical(
    group: WorkerGroup, models: dict, tmp_path: Path
) -> None:
    path = models["llama"]
    config = _engine(path, 2, 2, **TRAIN, lr_schedule="cosine", warmup_steps=2, total_steps=6)
    first, second = (rollout_batch(B, P, R, _vocab(path), seed=s) for s in (31, 32))
    ckpt = str(tmp_path / "ckpt")
    run_a, run_b, steps = resumed_runs(group, config, first, second, ckpt)

    assert steps == [1, 1, 1, 1]
    assert run_a.rand == run_b.rand  # each rank's RNG restored
    assert run_a.metrics == run_b.metrics  # same lr (schedule), loss, grad norm: optimizer too
    assert run_a.metrics[0]["lr"] == TRAIN["lr"]  # step 2 of a 2-step warm-up
    differ = sorted(n for n, t in run_a.weights.items() if not torch.equal(t, run_b.weights[n]))
    assert not differ, differ
    bad = _engine(path, 1, 2, **TRAIN)  # another layout must be refused, naming both
    group.build("run_c", bad)
    with pytest.raises(Exception, match="layout"):
        group.load("run_c", ckpt)
    group.drop("run_c")
