"""The 3D-HybridEngine on four Ray ranks: training (p=2, t=2) -> generation (p_g=1, t_g).

After one update, the actor's weights are resharded into a colocated rollout engine: the HF
engine (whole tensors) for ``t_g = 1``, the megatron TP engine (TP slices) for ``t_g = 2``.
Checked per rank: bytes received equal Table 2 of the paper exactly (the paper's plan and
the naive one), the units received are the plan's, the training shard is reused (zero
redundancy), the OS saw about that many bytes leave the process, and greedy generation
afterwards equals HF ``generate`` with the updated weights.

Every layout here moves bytes to every rank (Table 2's share is > 0), and the bytes are also
counted outside the reshard code -- at the all-gather calls and at the rollout engine's
``load_weights`` -- so neither a transfer that skips the collectives nor a sync that never
loads the rollout engine can pass on the reshard's own counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_core.batch import Batch
from hf_core.resharding import (
    GenerationLayout,
    ParallelLayout,
    hybrid_engine_volume_fraction,
    naive_volume_fraction,
)
from hf_core.runtime import WorkerGroup
from hf_testing.workers import rollout_batch

TRAIN = ParallelLayout(pp=2, tp=2, dp=1, order="tp-dp-pp")
BUCKET = 16 * 1024
TEXTS = ["reverse 1234:", "12+7=", "hello", "abc def", "9", "reverse 55:", "x+y=", "ok!"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def trained_actor(group: WorkerGroup, models: dict) -> Iterator[dict]:
    """A TP=2 x PP=2 actor after one update, and the HF model holding the same weights."""
    path = models["qwen2_tied"]
    config = {
        "model_path": str(path),
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "lr": 1e-2,
        "micro_batch_size": 2,
    }
    group.build("actor", config)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    group.train(rollout_batch(8, 6, 7, vocab, seed=23), name="actor", loss="policy")
    weights = group.weights("actor")[0]
    model = AutoModelForCausalLM.from_pretrained(path)
    result = model.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = model.generate(
            **enc, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id
        )[:, enc["input_ids"].shape[1] :]
        initial = AutoModelForCausalLM.from_pretrained(path).generate(
            **enc, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id
        )[:, enc["input_ids"].shape[1] :]
    assert not torch.equal(expected, initial)  # the update changed greedy outputs
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    canonical = sum(t.numel() * t.element_size() for t in weights.values())  # lm_head tied
    yield {"path": path, "prompts": prompts, "expected": expected, "canonical_bytes": canonical}
    group.drop("actor")


def _formula(kind: str, t_g: int) -> Fraction:
    """Table 2 per rank: HybridFlow (tp - t_g p_g) / (t_g p_g tp); HybridFlow-V (tp - 1) / tp."""
    tp, gg = TRAIN.model_parallel_size, t_g * 1
    exact = Fraction(tp - gg, gg * tp) if kind == "hybrid" else Fraction(tp - 1, tp)
    core = (
        hybrid_engine_volume_fraction(TRAIN, GenerationLayout(pp=1, tp=t_g))
        if kind == "hybrid"
        else naive_volume_fraction(TRAIN)
    )
    assert float(exact) == core  # core's formula functions agree
    return exact


@pytest.mark.parametrize(("t_g", "kind"), [(1, "hybrid"), (2, "hybrid"), (2, "naive")])
def test_reshard_volume_redundancy_and_generation(
    group: WorkerGroup, trained_actor: dict, t_g: int, kind: str
) -> None:
    name = f"rollout_{t_g}_{kind}"
    engine = group.build_rollout(name, "actor", str(trained_actor["path"]), t_g, kind)[0]
    assert engine == ("TransformersRolloutEngine" if t_g == 1 else "MegatronRolloutEngine")
    before = group.generate(trained_actor["prompts"], rollout=name, params=GREEDY)
    stats = group.sync("actor", rollout=name, t_g=t_g, kind=kind, bucket_bytes=BUCKET)
    after = group.generate(trained_actor["prompts"], rollout=name, params=GREEDY)

    model_bytes = {s["model_bytes"] for s in stats}
    assert len(model_bytes) == 1
    total = model_bytes.pop()
    fraction = _formula(kind, t_g)
    assert fraction > 0  # a layout where every rank must receive
    for rank, s in enumerate(stats):
        # Table 2, exactly: bytes received = formula x M (M = the model as gathered).
        assert Fraction(s["received_bytes"], total) == fraction, (rank, s["received_bytes"])
        # ... as the all-gather calls themselves moved them; and the rollout engine's
        # load_weights took the generation shard: the whole model at t_g = 1, its 1 / t_g
        # slices (plus the replicated norms) at t_g = 2
        moved = s["transport"]
        assert moved["gathered_bytes"] == s["received_bytes"], (rank, moved)
        assert moved["gathers"] == s["collectives"] > 0, (rank, moved)
        assert moved["loaded_bytes"] == s["emitted_bytes"], (rank, moved)
        canonical = trained_actor["canonical_bytes"]
        assert canonical / t_g <= moved["loaded_bytes"] <= canonical, (rank, moved, canonical)
        if t_g == 1:
            assert moved["loaded_bytes"] == canonical
        assert [tuple(u) for u in s["received_units"]] == [
            tuple(u) for u in s["recv_units_planned"]
        ]
        assert tuple(s["own_unit"]) not in {tuple(u) for u in s["received_units"]}
        # the OS saw this process send about what the all-gathers move (gloo headers aside)
        assert s["received_bytes"] <= s["wire_bytes_written"] <= 1.3 * s["received_bytes"] + 2**20
        # streamed: one bucket plus the tensors in flight, far from a second model
        assert s["peak_buffer_bytes"] < total / 2
        if kind == "hybrid":
            assert s["zero_redundancy"], s
            assert s["gather_group"] == tuple(sorted(s["gather_group"]))
            assert len(s["gather_group"]) == 4 // t_g
        else:
            assert not s["zero_redundancy"]  # gathers units outside its generation shard
            assert len(s["gather_group"]) == 4
    if kind == "hybrid" and t_g == 2:
        assert all(s["reused_bytes"] > 0 for s in stats)  # own parameters used in place

    expected = trained_actor["expected"]
    width = expected.shape[1]
    got, mask = after["responses"][:, :width], after["response_mask"][:, :width].bool()
    assert got.shape == expected.shape
    assert torch.equal(got[mask], expected[mask])
    assert not torch.equal(before["responses"], after["responses"])  # the sync did something
    group.drop(name)
