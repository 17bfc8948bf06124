"""The conformance checks every training engine passes, as a pytest class to subclass.

A backend's tests run them with a few lines::

    class TestFSDPConformance(TrainingEngineConformance):
        engine = "fsdp"
        engine_config: ClassVar[dict[str, Any]] = {"lr": 1e-3}
        capabilities = frozenset({ExportsHF, Offloadable})

The engine is built through the plugin registry (``get_training_engine(engine)``) in the
test process, once per class, on a tiny random model from :mod:`hf_testing.tiny`.  Engines
that need torch.distributed start a one-rank group themselves when none exists (both
existing backends do); the checkpoint check builds two more engines of the same layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from hf_core.algorithms.distill_top_k import top_k_distill_loss
from hf_core.batch import Batch
from hf_core.engines import (
    Closeable,
    ExportsHF,
    HasWorkerMesh,
    NamedTensor,
    Offloadable,
    TrainingEngine,
    TrainsAdapters,
)
from hf_core.engines.top_k import (
    LOG_PROBS_AT_TEACHER_TOP_K,
    TEACHER_TOP_K_IDS,
    TEACHER_TOP_K_LOG_PROBS,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
)
from hf_core.plugins import get_training_engine
from hf_testing.conformance.common import EngineConformance, check_bytes
from hf_testing.conformance.reference import (
    folder_tensors,
    hf_causal_lm,
    hf_log_probs_and_entropy,
    hf_log_probs_at,
    hf_top_k,
    masked_max_diff,
)
from hf_testing.workers import policy_loss, rollout_batch

TRAINING_CAPABILITIES: tuple[type, ...] = (
    HasWorkerMesh,
    ExportsHF,
    Offloadable,
    Closeable,
    TrainsAdapters,
)
CAPABILITY_CHECKS: dict[type, str] = {
    ExportsHF: "test_export_hf_loads_with_from_pretrained",
    Offloadable: "test_offload_and_onload_keep_the_model",
    HasWorkerMesh: "test_worker_mesh_covers_the_world",
}
"""The check each optional capability adds (collected only for engines declaring it)."""
MOE_CHECKS: tuple[str, ...] = (
    "test_moe_exported_names_and_tensors_equal_the_hf_folder",
    "test_moe_log_probs_equal_transformers",
    "test_moe_trained_weights_export_round_trip",
)
"""The mixture-of-experts checks (collected for engines declaring
``mixture_of_experts = "runs"``), on :attr:`~EngineConformance.moe_model`."""


def exported(engine: TrainingEngine, bucket_bytes: int = 1 << 20) -> dict[str, torch.Tensor]:
    """The engine's canonical weights, cloned bucket by bucket (a bucket may be reused)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in engine.export_weights(bucket_bytes):
        for name, tensor in bucket:
            assert name not in out, f"{name} exported twice"
            out[name] = tensor.detach().clone()
    return out


_FUSED = re.compile(r"^(.*\.)(?:q_proj|k_proj|v_proj|gate_proj|up_proj)(\.\w+)$")


def fused_units(bucket: list[NamedTensor]) -> dict[str, int]:
    """Bytes per unit of a bucket: one per tensor, except that a layer's q/k/v (weight and
    bias) and its gate/up count as one unit each, as fused backends hold them."""
    units: dict[str, int] = {}
    for name, tensor in bucket:
        match = _FUSED.match(name)
        if match:
            part = "qkv" if re.search(r"\.[qkv]_proj\.", name) else "gate_up"
            name = f"{match.group(1)}{part}"
        units[name] = units.get(name, 0) + tensor.numel() * tensor.element_size()
    return units


class TrainingEngineConformance(EngineConformance):
    """Checks of the :class:`~hf_core.engines.TrainingEngine` contract for one registered engine.

    Subclass it as ``Test...`` and set :attr:`engine` (``get_training_engine(engine)``);
    :attr:`engine_config` must allow training (a ``train_step``).  The other attributes
    have defaults.
    """

    log_prob_atol: ClassVar[float] = 1e-5
    """float32 on both sides, same math as transformers: only summation order differs."""
    batch_shape: ClassVar[tuple[int, int, int]] = (8, 6, 7)
    """Sequences, prompt length, response length of the test batches."""

    registry = staticmethod(get_training_engine)
    all_capabilities = TRAINING_CAPABILITIES
    capability_checks = CAPABILITY_CHECKS
    moe_checks = MOE_CHECKS
    _kit = True

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def training_engine(cls, conformance_model: Path) -> TrainingEngine:
        """One engine for the checks that only read it (none trains it)."""
        return cls.make_engine(conformance_model)

    @pytest.fixture(scope="class")
    @classmethod
    def moe_training_engine(cls, moe_conformance_model: Path) -> TrainingEngine:
        """One engine on the MoE model for the MoE checks that only read it."""
        return cls.make_engine(moe_conformance_model)

    def batch(self, model_path: Path, seed: int) -> Batch:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        return rollout_batch(*self.batch_shape, vocab, seed=seed)

    # ------------------------------------------------------------------ checks
    def test_is_a_training_engine(self, training_engine: TrainingEngine) -> None:
        assert isinstance(training_engine, TrainingEngine)

    def test_exported_names_and_tensors_equal_the_hf_folder(
        self, training_engine: TrainingEngine, conformance_model: Path
    ) -> None:
        """At init the canonical export is the folder itself: same names, bit-equal tensors."""
        got = exported(training_engine)
        expected = folder_tensors(conformance_model)
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype, name
            assert torch.equal(got[name].cpu(), tensor), name

    def test_export_buckets_respect_bucket_bytes(self, training_engine: TrainingEngine) -> None:
        """Each bucket holds at most ``bucket_bytes`` besides its largest unit, so a sync
        needs about one bucket of extra memory.  A unit is a tensor or the parts of one
        tensor a backend fuses (a layer's q/k/v, gate/up), which may only travel together."""
        whole = exported(training_engine)
        largest = max(t.numel() * t.element_size() for t in whole.values())
        limit = largest // 2  # some tensors are too big for a bucket and must travel alone
        buckets = [
            [(n, t.detach().clone()) for n, t in bucket]
            for bucket in training_engine.export_weights(limit)
        ]
        assert len(buckets) > len(whole) // 4  # really bucketed, not one blob
        for bucket in buckets:
            assert bucket, "empty bucket"
            units = fused_units(bucket)
            rest = sum(units.values()) - max(units.values())
            assert rest <= limit, (limit, units)
        assert any(len(fused_units(b)) > 1 for b in buckets)  # small tensors share buckets
        streamed = dict(pair for bucket in buckets for pair in bucket)
        assert list(streamed) == list(whole)  # same order whatever the bucket size
        assert all(torch.equal(streamed[n], whole[n]) for n in whole)

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_log_probs_equal_transformers(
        self, training_engine: TrainingEngine, conformance_model: Path, temperature: float
    ) -> None:
        batch = self.batch(conformance_model, seed=11)
        out = training_engine.compute_log_probs(batch, temperature=temperature)
        model = hf_causal_lm(conformance_model)
        expected, entropy = hf_log_probs_and_entropy(model, batch, temperature)
        mask = batch["response_mask"]
        assert out["log_probs"].shape == expected.shape == mask.shape
        assert masked_max_diff(out["log_probs"], expected, mask) < self.log_prob_atol
        assert masked_max_diff(out["entropy"], entropy, mask) < self.log_prob_atol
        # the tolerance is far below what a wrong temperature or position would change
        other, _ = hf_log_probs_and_entropy(model, batch, temperature + 0.3)
        assert masked_max_diff(other, expected, mask) > 100 * self.log_prob_atol

    def test_top_k_equals_transformers(
        self, training_engine: TrainingEngine, conformance_model: Path
    ) -> None:
        """``compute_log_probs(top_k=k)``: a teacher's top-k ids and log-probs per response
        position (top-k distillation) are transformers' own."""
        batch = self.batch(conformance_model, seed=15)
        out = training_engine.compute_log_probs(batch, temperature=0.7, top_k=4)
        expected_log_probs, expected_ids = hf_top_k(hf_causal_lm(conformance_model), batch, 0.7, 4)
        mask = batch["response_mask"].bool()
        assert out[TOP_K_IDS].shape == out[TOP_K_LOG_PROBS].shape == (*mask.shape, 4)
        assert torch.equal(out[TOP_K_IDS][mask].long(), expected_ids[mask])
        gap = (out[TOP_K_LOG_PROBS][mask] - expected_log_probs[mask]).abs().max()
        assert float(gap) < self.log_prob_atol
        assert "log_probs" in out and "entropy" in out  # the usual outputs still come

    def test_a_training_forward_scores_a_teachers_top_k_and_learns_from_it(
        self, conformance_model: Path
    ) -> None:
        """A batch carrying ``teacher_top_k_ids`` hands the loss the model's log-probs at
        those ids (transformers' own, micro-batch by micro-batch), and steps on the top-k
        forward KL toward another model's top-k lower that divergence."""
        batch = self.batch(conformance_model, seed=16)
        teacher = hf_causal_lm(conformance_model)
        torch.manual_seed(0)
        with torch.no_grad():  # another model: the conformance model with noisy weights
            for param in teacher.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        teacher_log_probs, teacher_ids = hf_top_k(teacher, batch, 1.0, 3)
        batch[TEACHER_TOP_K_IDS], batch[TEACHER_TOP_K_LOG_PROBS] = teacher_ids, teacher_log_probs
        student = hf_causal_lm(conformance_model)
        gaps: list[float] = []

        def loss(outputs: Mapping[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict]:
            scored = outputs[LOG_PROBS_AT_TEACHER_TOP_K]
            if not gaps:  # the first step: the weights are still the folder's
                expected = hf_log_probs_at(student, mb, mb[TEACHER_TOP_K_IDS].long(), 1.0)
                mask = mb["response_mask"].bool()
                gaps.append(float((scored.detach()[mask] - expected[mask]).abs().max()))
            divergence, metrics = top_k_distill_loss(
                scored, mb[TEACHER_TOP_K_LOG_PROBS], mb["response_mask"], loss="forward_kl_topk"
            )
            return divergence * mb.meta["dp_size"] * len(mb) / mb.meta["global_batch_size"], metrics

        run = self.make_engine(conformance_model)
        divergences = [run.train_step(batch, loss)["distill/forward_kl_topk"] for _ in range(4)]
        assert gaps and gaps[0] < self.log_prob_atol
        assert divergences[-1] < 0.9 * divergences[0], divergences

    def test_checkpoint_resumes_to_an_identical_next_step(
        self, conformance_model: Path, tmp_path: Path
    ) -> None:
        """save -> load into a fresh engine -> the next train step is bit-identical."""
        first, second = (self.batch(conformance_model, seed=s) for s in (31, 32))
        run = self.make_engine(conformance_model)
        initial = exported(run)
        run.train_step(first, policy_loss)
        saved = exported(run)
        assert any(not torch.equal(saved[n], initial[n]) for n in initial)  # it trained
        run.save_checkpoint(tmp_path / "ckpt")
        expected_metrics = run.train_step(second, policy_loss)
        expected = exported(run)

        resumed = self.make_engine(conformance_model)
        resumed.load_checkpoint(tmp_path / "ckpt")
        loaded = exported(resumed)
        assert all(torch.equal(loaded[n], saved[n]) for n in saved)
        metrics = resumed.train_step(second, policy_loss)
        assert metrics == expected_metrics  # same loss, grad norm, lr: optimiser state too
        after = exported(resumed)
        differ = sorted(n for n in expected if not torch.equal(after[n], expected[n]))
        assert not differ, differ

    def test_capabilities_are_the_declared_protocols(self, training_engine: TrainingEngine) -> None:
        self.check_declared_capabilities(training_engine)

    def test_export_hf_loads_with_from_pretrained(
        self, training_engine: TrainingEngine, conformance_model: Path, tmp_path: Path
    ) -> None:
        from transformers import AutoTokenizer

        assert isinstance(training_engine, ExportsHF)
        folder = Path(training_engine.export_hf(tmp_path / "hf", tokenizer=conformance_model))
        model = hf_causal_lm(folder)
        state = model.state_dict()
        for name, tensor in folder_tensors(conformance_model).items():
            assert torch.equal(state[name], tensor), name
        assert len(AutoTokenizer.from_pretrained(folder)) == model.config.vocab_size
        batch = self.batch(conformance_model, seed=12)
        expected, _ = hf_log_probs_and_entropy(model, batch, 1.0)
        got = training_engine.compute_log_probs(batch)["log_probs"]
        assert masked_max_diff(got, expected, batch["response_mask"]) < self.log_prob_atol

    def test_offload_and_onload_keep_the_model(
        self, training_engine: TrainingEngine, conformance_model: Path
    ) -> None:
        """The hand-over core makes every step: offload and onload return the bytes they move
        (on a CPU-only run the bytes they would move), twice in a row the second moves
        nothing where the engine tracks ``offloaded``, and the model is unchanged after."""
        assert isinstance(training_engine, Offloadable)
        batch = self.batch(conformance_model, seed=13)
        before = training_engine.compute_log_probs(batch)["log_probs"]
        weights = exported(training_engine)
        try:
            moved = check_bytes("offload", training_engine.offload(), positive=True)
            again = check_bytes("offload", training_engine.offload())
            tracked = getattr(training_engine, "offloaded", None)
        finally:
            back = check_bytes("onload", training_engine.onload(), positive=True)
        if tracked is not None:
            assert tracked is True, "offloaded is False after offload()"
            assert again == 0, f"a second offload() moved {again} bytes"
            assert getattr(training_engine, "offloaded", None) is False
            assert check_bytes("onload", training_engine.onload()) == 0
        assert back == moved, f"onload() brought back {back} bytes, offload() moved {moved}"
        after = exported(training_engine)
        assert all(torch.equal(after[n], weights[n]) for n in weights)
        assert torch.equal(training_engine.compute_log_probs(batch)["log_probs"], before)
        self.check_trained_offload_counts_more(conformance_model, moved)

    def check_trained_offload_counts_more(self, conformance_model: Path, untrained: int) -> None:
        """After a step the optimiser holds state (Adam's moments), which offload moves too:
        an engine that counted parameters only would report the untrained number again."""
        run: TrainingEngine = self.make_engine(conformance_model)
        assert isinstance(run, Offloadable)
        batch = self.batch(conformance_model, seed=14)
        run.train_step(batch, policy_loss)
        moved = check_bytes("offload", run.offload(), positive=True)
        assert moved > untrained, (moved, untrained)
        assert check_bytes("onload", run.onload()) == moved
        assert run.train_step(batch, policy_loss)["update_skipped"] == 0.0  # state came back

    def test_worker_mesh_covers_the_world(self, training_engine: TrainingEngine) -> None:
        import torch.distributed as dist

        from hf_core.protocols import WorkerMesh

        assert isinstance(training_engine, HasWorkerMesh)
        mesh = training_engine.worker_mesh()
        assert isinstance(mesh, WorkerMesh)
        world = dist.get_world_size() if dist.is_initialized() else 1
        assert mesh.dp_size * mesh.tp_size * mesh.pp_size * mesh.sp_size == world

    # -------------------------------------------------------- mixture of experts
    def test_moe_exported_names_and_tensors_equal_the_hf_folder(
        self, moe_training_engine: TrainingEngine, moe_conformance_model: Path
    ) -> None:
        """An MoE model's canonical export is the checkpoint's per-expert tensors
        (``...mlp.experts.E.gate_proj.weight``), bit-equal to the folder, however the engine
        holds them (transformers 5 fuses them; megatron groups them)."""
        got = exported(moe_training_engine)
        expected = folder_tensors(moe_conformance_model)
        assert any(".experts.0." in name for name in expected)
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name].cpu(), tensor), name

    def test_moe_log_probs_equal_transformers(
        self, moe_training_engine: TrainingEngine, moe_conformance_model: Path
    ) -> None:
        batch = self.batch(moe_conformance_model, seed=41)
        out = moe_training_engine.compute_log_probs(batch)
        model = hf_causal_lm(moe_conformance_model)
        expected, entropy = hf_log_probs_and_entropy(model, batch, 1.0)
        mask = batch["response_mask"]
        assert masked_max_diff(out["log_probs"], expected, mask) < self.log_prob_atol
        assert masked_max_diff(out["entropy"], entropy, mask) < self.log_prob_atol

    def test_moe_trained_weights_export_round_trip(self, moe_conformance_model: Path) -> None:
        """After a train step the exported per-expert tensors, loaded into transformers'
        model, give the engine's own log-probs: what a weight sync hands a rollout engine is
        the model the trainer has."""
        run = self.make_engine(moe_conformance_model)
        initial = exported(run)
        run.train_step(self.batch(moe_conformance_model, seed=42), policy_loss)
        trained = exported(run)
        changed = [n for n in initial if not torch.equal(trained[n].cpu(), initial[n].cpu())]
        assert any(".experts." in n for n in changed), "no expert weight trained"
        assert any(n.endswith("gate.weight") for n in changed), "no router trained"
        batch = self.batch(moe_conformance_model, seed=43)
        model = hf_causal_lm(moe_conformance_model, {n: t.cpu() for n, t in trained.items()})
        expected, _ = hf_log_probs_and_entropy(model, batch, 1.0)
        got = run.compute_log_probs(batch)["log_probs"]
        assert masked_max_diff(got, expected, batch["response_mask"]) < self.log_prob_atol
        if isinstance(run, Closeable):
            run.close()
