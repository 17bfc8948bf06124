"""One-rank engines in the test process: loading errors, heads, rollout, export, checkpoints."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_core.batch import Batch
from hf_core.engines import SamplingParams, filter_logits
from hf_core.resharding import GenerationLayout, ParallelLayout, build_hybrid_plan
from hf_fsdp.checkpoint import CheckpointError
from hf_fsdp.engine import FSDPEngine
from hf_fsdp.loading import ModelLoadError
from hf_fsdp.rollout import TransformersRolloutEngine
from hf_testing.workers import policy_loss, rollout_batch

VOCAB = 128


def _weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in engine.export_weights(1 << 20) for n, t in bucket}


def _prompts(path: Path, texts: list[str]) -> tuple[Batch, dict]:
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}), enc


TEXTS = ["reverse 1234:", "12+7=", "hello", "abc def ghi"]


# -------------------------------------------------------------------------- loading


def test_bad_weights_are_clear_errors(models: dict, tmp_path: Path) -> None:
    src = models["llama"]
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(src / "config.json", no_weights)
    with pytest.raises(FileNotFoundError, match=r"no_weights has no model\.safetensors"):
        FSDPEngine({"model_path": str(no_weights)})

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(src, wrong_shape)
    config = json.loads((wrong_shape / "config.json").read_text())
    config["vocab_size"] += 1
    (wrong_shape / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"embed_tokens.weight' has shape \(128, 64\) on disk"):
        FSDPEngine({"model_path": str(wrong_shape)})

    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as info:
        FSDPEngine({"model_path": str(missing)})
    assert str(missing) in str(info.value)


def test_value_head_on_a_causal_lm_folder_is_initialised_from_seed(models: dict) -> None:
    path = str(models["llama"])
    critic = FSDPEngine({"model_path": path, "head": "value", "seed": 5})
    assert sorted(critic.load_report.initialized) == ["score.bias", "score.weight"]
    assert "lm_head.weight" in critic.load_report.unused
    again = FSDPEngine({"model_path": path, "head": "value", "seed": 5})
    other = FSDPEngine({"model_path": path, "head": "value", "seed": 6})
    w, w_again, w_other = (_weights(e)["score.weight"] for e in (critic, again, other))
    assert torch.equal(w, w_again) and not torch.equal(w, w_other)
    assert float(w.std()) > 0.05  # initializer_range, not zeros
    batch = rollout_batch(4, 5, 6, VOCAB, seed=1)
    values = critic.compute_values(batch)["values"]
    assert values.shape == (4, 6) and torch.isfinite(values).all()
    with pytest.raises(NotImplementedError, match="needs head='lm'"):
        critic.compute_log_probs(batch)


def test_fsdp_units_per_layer_or_whole_model(models: dict) -> None:
    from torch.distributed.fsdp import FSDPModule

    path = str(models["qwen2_tied"])
    batch = rollout_batch(4, 5, 6, VOCAB, seed=3)
    engines = {
        unit: FSDPEngine(
            {
                "model_path": path,
                "fsdp_unit": unit,
                "trainable": False,
                "cpu_data_parallel": "fsdp",
            }
        )
        for unit in ("auto", "layer", "model")
    }
    # one CPU process trains a plain module by default (hf_fsdp.data_parallel.cpu_replicas)
    engines["plain"] = FSDPEngine({"model_path": path, "trainable": False})
    units = {
        k: sum(isinstance(m, FSDPModule) for m in e.model.modules()) for k, e in engines.items()
    }
    layers = engines["layer"].hf_config.num_hidden_layers
    assert units == {"auto": 1, "layer": layers + 1, "model": 1, "plain": 0}  # tiny: auto = 1
    out = {k: e.compute_log_probs(batch)["log_probs"] for k, e in engines.items()}
    assert torch.allclose(out["layer"], out["model"], atol=1e-6)
    assert torch.allclose(out["plain"], out["model"], atol=1e-6)


def test_a_plain_single_process_engine_trains_and_resumes_as_fsdp_does(
    models: dict, tmp_path: Path
) -> None:
    """The plain module of one CPU process: the same update as FSDP's, tied weights still
    tied, and its checkpoint loads into an FSDP engine (a later run on FSDP resumes it)."""
    path = str(models["qwen2_tied"])
    batch = rollout_batch(6, 5, 6, VOCAB, seed=5, group_size=2)
    plain, wrapped = (
        FSDPEngine({"model_path": path, "lr": 1e-3, "cpu_data_parallel": mode})
        for mode in ("replicate", "fsdp")
    )
    assert (plain.data_parallel_strategy(), wrapped.data_parallel_strategy()) == (
        "cpu_replicas",
        "fsdp2",
    )
    head = plain.model.get_output_embeddings().weight
    assert head is plain.model.get_input_embeddings().weight  # the tie survived loading
    steps = [e.train_step(batch, policy_loss) for e in (plain, wrapped)]
    assert steps[0]["grad_norm"] == pytest.approx(steps[1]["grad_norm"], rel=1e-5)
    trained = _weights(plain)
    for name, value in _weights(wrapped).items():
        assert torch.allclose(trained[name], value, atol=1e-5), name
    plain.save_checkpoint(tmp_path / "ckpt")
    resumed = FSDPEngine({"model_path": path, "lr": 1e-3, "cpu_data_parallel": "fsdp"})
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    for name, value in _weights(resumed).items():
        assert torch.equal(trained[name], value), name
    after = [e.train_step(batch, policy_loss)["loss"] for e in (plain, resumed)]
    assert after[0] == pytest.approx(after[1], rel=1e-5)


def test_micro_batch_size_does_not_change_results(models: dict) -> None:
    path = str(models["qwen2_tied"])
    batch = rollout_batch(6, 5, 6, VOCAB, seed=2)
    one = FSDPEngine({"model_path": path, "micro_batch_size": 1, "trainable": False})
    four = FSDPEngine({"model_path": path, "micro_batch_size": 4, "trainable": False})
    a, b = one.compute_log_probs(batch), four.compute_log_probs(batch)
    assert torch.allclose(a["log_probs"], b["log_probs"], atol=1e-5)
    assert a["log_probs"].shape == (6, 6)


def _tokens_through(engine: FSDPEngine) -> list[int]:
    """Tokens each forward of ``engine`` embeds (appended as they run)."""
    seen: list[int] = []
    embed = engine.model.get_input_embeddings()
    embed.register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].numel())))
    return seen


@pytest.mark.parametrize(("name", "attention"), [("qwen2_tied", "sdpa"), ("llama", "eager")])
def test_shared_prefix_forward_computes_each_prompt_once_with_the_same_results(
    models: dict, name: str, attention: str
) -> None:
    """Rows repeating a prompt (GRPO's samples) go through as one packed row per prompt:
    fewer tokens, the same log-probs, entropy, gradients and values as plain rows."""
    batch = rollout_batch(12, 9, 6, VOCAB, seed=4, group_size=4)
    engines = {
        packed: FSDPEngine(
            {
                "model_path": str(models[name]),
                "lr": 1e-2,
                "shared_prefix": packed,
                "sequence_packing": False,  # the unpacked side: plain padded rows
                "attn_implementation": attention,
            }
        )
        for packed in (True, False)
    }
    tokens = {packed: _tokens_through(e) for packed, e in engines.items()}
    out = {packed: e.compute_log_probs(batch) for packed, e in engines.items()}
    assert sum(tokens[True]) < 0.8 * sum(tokens[False]), tokens
    for key in ("log_probs", "entropy"):
        assert torch.allclose(out[True][key], out[False][key], atol=1e-5), key
    assert out[True]["log_probs"][batch["response_mask"] == 1].lt(0).all()
    # the gradient flows through the shared prompt to every sample (Adam's first step would
    # turn rounding-level gradients into lr-sized moves, so compare the metrics it reports)
    steps = {packed: e.train_step(batch, policy_loss) for packed, e in engines.items()}
    for key in ("loss", "grad_norm", "pg_loss"):
        assert steps[True][key] == pytest.approx(steps[False][key], rel=1e-4, abs=1e-6), key
    assert sum(tokens[True]) < 0.8 * sum(tokens[False]), tokens

    critics = [
        FSDPEngine(
            {
                "model_path": str(models["value"]),
                "head": "value",
                "shared_prefix": packed,
                "sequence_packing": False,
            }
        )
        for packed in (True, False)
    ]
    values = [c.compute_values(batch)["values"] for c in critics]
    assert torch.allclose(values[0], values[1], atol=1e-5)


def _gradients_at_step(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """The gradients the optimizer is about to apply, captured at each step (a hook)."""
    captured: dict[str, torch.Tensor] = {}

    def capture(*_args: object) -> None:
        for name, p in engine.model.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                captured[name] = grad.detach().clone()

    assert engine.optimizer is not None
    engine.optimizer.register_step_pre_hook(capture)
    return captured


@pytest.mark.parametrize(("name", "attention"), [("qwen2_tied", "sdpa"), ("llama", "eager")])
def test_sequence_packing_equals_padded_rows_without_computing_padding(
    models: dict, name: str, attention: str
) -> None:
    """Samples of mixed lengths back to back in one row: the same log-probs, loss and
    gradients as padded rows, and no padding token computed (the engine's counter)."""
    batch = rollout_batch(8, 12, 10, VOCAB, seed=6)  # prompts and responses of mixed lengths
    lengths = batch["attention_mask"].sum(-1)
    assert int(lengths.max() - lengths.min()) >= 8
    engines = {
        packed: FSDPEngine(
            {
                "model_path": str(models[name]),
                "lr": 1e-2,
                "sequence_packing": packed,
                "attn_implementation": attention,
            }
        )
        for packed in (True, False)
    }
    tokens = {packed: _tokens_through(e) for packed, e in engines.items()}
    out = {packed: e.compute_log_probs(batch) for packed, e in engines.items()}
    assert sum(tokens[True]) == int(batch["attention_mask"].sum()) < sum(tokens[False])
    mask = batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert float((out[True][key] - out[False][key])[mask].abs().max()) < 1e-5, key
    grads = {packed: _gradients_at_step(e) for packed, e in engines.items()}
    steps = {packed: e.train_step(batch, policy_loss) for packed, e in engines.items()}
    assert steps[True]["padding_tokens_sum"] == 0 < steps[False]["padding_tokens_sum"]
    assert steps[True]["loss"] == pytest.approx(steps[False]["loss"], rel=1e-5, abs=1e-6)
    assert grads[True].keys() == grads[False].keys() and grads[True]
    worst = max(float((grads[True][k] - grads[False][k]).abs().max()) for k in grads[True])
    assert worst < 1e-5, worst


def test_train_step_metrics_and_schedule(models: dict) -> None:
    engine = FSDPEngine(
        {"model_path": str(models["llama"]), "lr": 1e-3, "warmup_steps": 2, "micro_batch_size": 3}
    )
    batch = rollout_batch(6, 5, 6, VOCAB, seed=3)
    first = engine.train_step(batch, policy_loss)
    second = engine.train_step(batch, policy_loss)
    assert first["lr"] == pytest.approx(5e-4) and second["lr"] == pytest.approx(1e-3)
    assert first["step"] == 1.0 and second["step"] == 2.0
    assert first["grad_norm"] > 0 and first["update_skipped"] == 0.0
    assert {"pg_loss", "loss"} <= set(first)


def test_export_with_trivial_plan_and_reject_tp_plan(models: dict) -> None:
    engine = FSDPEngine({"model_path": str(models["llama"]), "trainable": False})
    plan = build_hybrid_plan(ParallelLayout(pp=1, tp=1, dp=1), GenerationLayout(pp=1, tp=1))
    names = [n for bucket in engine.export_weights(4096, plan.for_rank(0)) for n, _ in bucket]
    assert names == list(engine.param_shapes)
    tp_plan = build_hybrid_plan(ParallelLayout(pp=1, tp=2, dp=1), GenerationLayout(pp=1, tp=1))
    with pytest.raises(NotImplementedError, match="pure DP"):
        engine.export_weights(4096, tp_plan.for_rank(0))


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_offload_on_cpu_moves_nothing_and_reports_the_bytes(
    models: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU the hand-over is measured but moves nothing: offload reports the bytes of
    parameters and buffers a GPU run would move, keeps the offloaded state (work is refused
    until onload, as on a GPU), and a second offload or onload reports 0."""
    engine = FSDPEngine({"model_path": str(models["llama"]), "trainable": False})
    before = _weights(engine)
    resident = _nbytes([*engine.model.parameters(), *engine.model.buffers()])
    assert resident >= 4 * engine.num_params  # float32 master weights, plus rotary buffers
    with caplog.at_level("INFO", logger="hf_fsdp.engine"):
        assert engine.offload() == resident
    assert "nothing to move" in caplog.text
    assert engine.offloaded and engine.offload() == 0
    with pytest.raises(RuntimeError, match=r"offloaded; call onload\(\) first"):
        engine.compute_log_probs(rollout_batch(2, 3, 4, VOCAB, seed=1))
    assert engine.onload() == resident
    assert not engine.offloaded and engine.onload() == 0
    assert {p.device.type for p in engine.model.parameters()} == {"cpu"}
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_offload_bytes_follow_the_config(models: dict) -> None:
    """After a step AdamW holds two moments per parameter; offload counts what the config
    says it moves: parameters (``offload_params``), optimiser state (``offload_optimizer``)."""
    full = _trained(models)
    params = _nbytes([*full.model.parameters(), *full.model.buffers()])
    moments = 2 * 4 * full.num_params  # exp_avg, exp_avg_sq in float32
    assert full.offload() == params + moments
    assert full.onload() == params + moments
    assert _trained(models, offload_params=False).offload() == moments
    assert _trained(models, offload_optimizer=False).offload() == params


def test_offload_counts_follow_state_that_appears_later(models: dict) -> None:
    """The CPU-only counts are sizes taken once: the optimiser's moments, which only exist
    after the first step, must still be counted once they do."""
    engine = FSDPEngine({"model_path": str(models["llama"])})
    params = _nbytes([*engine.model.parameters(), *engine.model.buffers()])
    assert engine.offload() == params  # no step yet: AdamW holds no state
    engine.onload()
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=4), policy_loss)
    assert engine.offload() == params + 2 * 4 * engine.num_params


def test_export_hf_in_shards_loads_with_from_pretrained(models: dict, tmp_path: Path) -> None:
    path = models["llama"]
    engine = FSDPEngine({"model_path": str(path), "tokenizer_path": str(path)})
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=4), policy_loss)
    out = engine.export_hf(tmp_path / "hf", shard_bytes=32 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    exported = _weights(engine)
    state = model.state_dict()
    assert set(state) == set(exported)
    assert all(torch.equal(state[k], exported[k]) for k in exported)
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size
    assert not list(tmp_path.glob(".hf.*"))  # no temporary folder left behind


# -------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("folder", ["qwen2_tied", "llama"])
def test_greedy_rollout_equals_hf_generate(models: dict, folder: str) -> None:
    path = models[folder]
    prompts, enc = _prompts(path, TEXTS)
    out = TransformersRolloutEngine({"model_path": str(path), "dtype": "float32"}).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=10)
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    expected = model.generate(**enc, do_sample=False, max_new_tokens=10, pad_token_id=0)
    expected = expected[:, enc["input_ids"].shape[1] :]
    n = expected.shape[1]
    mask = out["response_mask"][:, :n].bool()
    assert torch.equal(out["responses"][:, :n][mask], expected[mask])
    assert out["responses"].shape == (4, 10)
    assert torch.equal(out["prompts"], enc["input_ids"])
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"][:, enc["input_ids"].shape[1] :], out["response_mask"])
    # greedy log-probs are of the raw logits
    engine = FSDPEngine({"model_path": str(path), "trainable": False})
    recomputed = engine.compute_log_probs(out, temperature=0.0)["log_probs"]
    diff = (recomputed - out["rollout_log_probs"]) * out["response_mask"]
    assert float(diff.abs().max()) < 1e-4


def test_response_mask_stops_after_the_first_stop_token(models: dict) -> None:
    path = models["llama"]
    prompts, _ = _prompts(path, TEXTS)
    engine = TransformersRolloutEngine({"model_path": str(path)})
    free = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))
    stop = int(free["responses"][0, 3])
    out = engine.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,))
    )
    for row in range(4):
        tokens = free["responses"][row].tolist()
        length = tokens.index(stop) + 1 if stop in tokens else 10
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (10 - length)
        assert out["responses"][row, :length].tolist() == tokens[:length]
        assert set(out["responses"][row, length:].tolist()) <= {engine.pad_token_id}
        assert float(out["rollout_log_probs"][row, length:].abs().sum()) == 0.0
    assert out["response_mask"][0].sum() == 4


def test_sampling_n_seed_and_log_probs(models: dict) -> None:
    path = models["qwen2_tied"]
    prompts, _ = _prompts(path, TEXTS[:2])
    prompts["uid"] = ["a", "b"]
    engine = TransformersRolloutEngine({"model_path": str(path), "dtype": "float32"})
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, max_new_tokens=8, n=3, seed=7)
    out = engine.generate(prompts, params)
    assert len(out) == 6 and list(out["uid"]) == ["a"] * 3 + ["b"] * 3
    assert torch.equal(out["prompts"][0], out["prompts"][2])
    assert len({tuple(r) for r in out["responses"][:3].tolist()}) > 1  # samples differ
    again = engine.generate(prompts, params)
    assert torch.equal(out["responses"], again["responses"])
    other = engine.generate(prompts, params.model_copy(update={"seed": 8}))
    assert not torch.equal(out["responses"], other["responses"])
    assert out.meta["temperature"] == 0.9
    # log-probs are of softmax(logits / T) over the whole vocabulary, as the trainer computes
    trainer = FSDPEngine({"model_path": str(path), "trainable": False})
    recomputed = trainer.compute_log_probs(out, temperature=0.9)["log_probs"]
    diff = (recomputed - out["rollout_log_probs"]) * out["response_mask"]
    assert float(diff.abs().max()) < 1e-4


def test_filter_logits_keeps_top_k_and_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, -1, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, -1, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, -1, 0.76)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, -1, 0.01)).tolist() == [[True, False, False, False]]


def test_rollout_load_weights_in_place_and_errors(models: dict) -> None:
    engine = TransformersRolloutEngine({"model_path": str(models["qwen2_tied"])})
    embed = engine.model.model.embed_tokens.weight
    new = torch.randn_like(embed)
    engine.load_weights([("model.embed_tokens.weight", new)])
    engine.finish_weight_sync()
    assert torch.equal(embed, new) and engine.model.model.embed_tokens.weight is embed
    assert torch.equal(engine.model.lm_head.weight, new)  # tied
    assert engine.weight_version == 1
    with pytest.raises(KeyError, match=r"no parameter 'model\.nope\.weight'"):
        engine.load_weights([("model.nope.weight", new)])
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(KeyError, match="generate needs"):
        engine.generate(Batch({"x": torch.zeros(2)}), SamplingParams())


def test_rollout_release_reports_weight_bytes_on_cpu(models: dict) -> None:
    """The transformers rollout engine holds its weights (a tied embedding once) and no KV cache
    between generations: release reports those bytes, moves nothing on the CPU, a second
    release reports 0, and generation afterwards (resuming by itself) is unchanged."""
    engine = TransformersRolloutEngine({"model_path": str(models["qwen2_tied"])})
    weights = _nbytes([*engine.model.parameters(), *engine.model.buffers()])
    embed = engine.model.model.embed_tokens.weight
    everything = engine.model.named_parameters(remove_duplicate=False)
    assert weights < _nbytes(t for _, t in everything)  # the tied embedding once
    prompts, _ = _prompts(models["qwen2_tied"], TEXTS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(prompts, greedy)["responses"]
    assert engine.release_memory() == weights
    assert engine.release_memory() == 0
    assert torch.equal(engine.generate(prompts, greedy)["responses"], before)  # resumed itself
    assert engine.resume_memory() == 0
    assert engine.release_memory() == weights and engine.resume_memory() == weights
    assert engine.model.model.embed_tokens.weight is embed


# ---------------------------------------------------------------------- checkpoints


def _trained(models: dict, folder: str = "llama", **kw: object) -> FSDPEngine:
    engine = FSDPEngine({"model_path": str(models[folder]), "lr": 1e-3, **kw})
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=5), policy_loss)
    return engine


def test_checkpoint_errors_name_path_and_problem(models: dict, tmp_path: Path) -> None:
    engine = _trained(models)
    with pytest.raises(FileNotFoundError, match=f"checkpoint {tmp_path / 'none'} does not exist"):
        engine.load_checkpoint(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is incomplete .* no hybridflow_fsdp\.json"):
        engine.load_checkpoint(tmp_path / "empty")

    good = tmp_path / "good"
    engine.save_checkpoint(good)
    other = FSDPEngine({"model_path": str(models["qwen2_tied"])})
    with pytest.raises(CheckpointError, match=r"good does not fit .*lm_head.weight"):
        other.load_checkpoint(good)
    critic = FSDPEngine({"model_path": str(models["llama"]), "head": "value"})
    with pytest.raises(CheckpointError, match="head is 'lm' in the checkpoint, engine has 'value'"):
        critic.load_checkpoint(good)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    shard = next((truncated / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"truncated .*distcp is 100 bytes, expected"):
        engine.load_checkpoint(truncated)

    garbled = tmp_path / "garbled"
    shutil.copytree(good, garbled)
    meta = garbled / "dcp" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)  # same size, unreadable content
    with pytest.raises(CheckpointError, match=r"garbled could not be read \(damaged\?\)"):
        engine.load_checkpoint(garbled)


def test_crash_mid_save_keeps_the_last_good_checkpoint(
    models: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf_fsdp.checkpoint as ckpt

    engine = _trained(models)
    path = tmp_path / "ckpt"
    engine.save_checkpoint(path)
    saved = _weights(engine)
    engine.train_step(rollout_batch(4, 5, 6, VOCAB, seed=6), policy_loss)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        engine.save_checkpoint(path)
    monkeypatch.undo()

    fresh = FSDPEngine({"model_path": str(models["llama"]), "lr": 1e-3})
    fresh.load_checkpoint(path)
    assert fresh.step == 1
    restored = _weights(fresh)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)

    # A crash between "move the old one aside" and "move the new one in" leaves only the old.
    path.rename(tmp_path / ".ckpt.old-ckpt")
    fresh.load_checkpoint(path)
    assert fresh.step == 1

    engine.save_checkpoint(path)  # the next good save replaces everything cleanly
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fresh.load_checkpoint(path)
    assert fresh.step == 2


def test_checkpoint_before_any_step_keeps_a_fresh_optimizer(models: dict, tmp_path: Path) -> None:
    config = {"model_path": str(models["llama"]), "lr": 1e-3}
    batch = rollout_batch(4, 5, 6, VOCAB, seed=7)
    first = FSDPEngine(config)
    first.save_checkpoint(tmp_path / "step0")
    expected = first.train_step(batch, policy_loss)
    second = FSDPEngine(config)
    second.load_checkpoint(tmp_path / "step0")
    assert second.train_step(batch, policy_loss) == expected


def test_tied_model_resumes_identically(models: dict, tmp_path: Path) -> None:
    config = {"model_path": str(models["qwen2_tied"]), "lr": 1e-3, "warmup_steps": 3}
    first, second = (rollout_batch(4, 5, 6, VOCAB, seed=s) for s in (8, 9))
    run = FSDPEngine(config)
    run.train_step(first, policy_loss)
    run.save_checkpoint(tmp_path / "tied")
    expected = run.train_step(second, policy_loss)
    resumed = FSDPEngine(config)
    resumed.load_checkpoint(tmp_path / "tied")
    assert resumed.train_step(second, policy_loss) == expected
    a, b = _weights(run), _weights(resumed)
    assert list(a) == list(b) and "lm_head.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
