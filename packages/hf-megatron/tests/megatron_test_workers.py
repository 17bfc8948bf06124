"""A test worker hosting megatron engines and rollout engines (losses and batches:
hf_testing.workers), and the megatron-only test models and plans.

Importable by the Ray worker processes (the tests folder is on their PYTHONPATH), so loss
functions are passed by name rather than pickled from a test module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.engines import CanonicalSlice, NamedTensor, SamplingParams
from hf_core.protocols import register
from hf_core.resharding import GenerationLayout, build_hybrid_plan, build_naive_plan
from hf_testing.workers import engine_worker_base


def build_odd_vocab_model(path: Path, vocab_size: int) -> Path:
    """A random Llama with a vocabulary no TP size divides (no tokenizer: ids only)."""
    from transformers import AutoModelForCausalLM

    from hf_testing.tiny import tiny_config

    config = tiny_config("llama", vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def make_plan(layout: Any, t_g: int, kind: str) -> Any:
    build = build_hybrid_plan if kind == "hybrid" else build_naive_plan
    return build(layout, GenerationLayout(pp=1, tp=t_g))


GATHERS = ("all_gather_into_tensor", "all_gather_single")
"""The all-gathers a reshard may call (looked up on ``torch.distributed`` at call time)."""


@contextmanager
def count_transport(rollout: Any) -> Iterator[dict[str, int]]:
    """Bytes that went through ``torch.distributed``'s all-gathers (output minus this rank's
    input: what other ranks sent it) and into ``rollout.load_weights``, counted by wrapping
    those calls: a measure of the transfer that does not rely on the reshard's own counters."""
    counts = {"gathered_bytes": 0, "gathers": 0, "loaded_bytes": 0, "loaded_tensors": 0}
    depth = [0]  # one gather may call the other: count the outermost call only

    def wrap(gather: Callable[..., Any]) -> Callable[..., Any]:
        def counted(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts["gathers"] += 1
                counts["gathered_bytes"] += (out.numel() - inp.numel()) * out.element_size()
            depth[0] += 1
            try:
                return gather(out, inp, *args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    def load(bucket: Iterable[NamedTensor | CanonicalSlice]) -> None:
        items = list(bucket)
        for item in items:
            tensor = item.tensor if isinstance(item, CanonicalSlice) else item[1]
            counts["loaded_bytes"] += tensor.numel() * tensor.element_size()
            counts["loaded_tensors"] += 1
        real_load(items)

    originals = {name: getattr(dist, name) for name in GATHERS if hasattr(dist, name)}
    real_load = rollout.load_weights
    for name, gather in originals.items():
        setattr(dist, name, wrap(gather))
    rollout.load_weights = load
    try:
        yield counts
    finally:
        for name, gather in originals.items():
            setattr(dist, name, gather)
        del rollout.load_weights  # the class's method again


# ----------------------------------------------------------------------------- worker


class MegatronWorker(engine_worker_base("3D_PROTO")):
    """Hosts named megatron engines and rollout engines on each rank."""

    weight_bucket_bytes = 1 << 16

    @register("ONE_TO_ALL")
    def build(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        from hf_core.plugins import get_training_engine

        engine = get_training_engine("megatron")(**config)
        self.engines[name] = engine
        self.set_mesh(engine.worker_mesh())
        return {
            "coords": tuple(engine.layout.coords),
            "native": {n: tuple(p.shape) for n, p in engine.module.named_parameters()},
            "padded_vocab": engine.padded_vocab,
            "initialized": engine.initialized_heads,
        }

    @register("ONE_TO_ALL")
    def state_bytes(self, name: str) -> int:
        """Bytes of every distinct storage behind this rank's weights, gradient buffers and
        optimizer state (float32 master shards included): what the memory check's
        ``state_bytes_per_rank`` claims to count."""
        from hf_megatron.checkpoint import sub_optimizers

        engine = self.engines[name]
        tensors = [p for p in engine.module.parameters()]
        tensors += [p.main_grad for p in engine.module.parameters() if hasattr(p, "main_grad")]
        for sub in sub_optimizers(engine.optimizer):
            for group in sub.optimizer.param_groups:
                tensors += group["params"]  # float32 master shards of 16-bit weights
            for state in sub.optimizer.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    @register("ONE_TO_ALL")
    def log_probs_everywhere(
        self, batch: Batch, name: str, temperature: float = 1.0, top_k: int = 0
    ) -> Batch:
        """The whole batch on every rank: what each rank (not just the collected one) returns."""
        return self.engines[name].compute_log_probs(batch, temperature=temperature, top_k=top_k)

    @register("ONE_TO_ALL")
    def build_rollout(self, name: str, engine: str, model_path: str, t_g: int, kind: str) -> str:
        """An transformers engine (t_g = 1) or a megatron TP rollout engine on the plan's mesh."""
        from hf_core.plugins import get_rollout_engine

        source = self.engines[engine]
        plan = source.reshard_plan(gen_tp=t_g, kind=kind)
        if t_g == 1:
            rollout = get_rollout_engine("transformers")(model_path=model_path, dtype="float32")
        else:
            rollout = get_rollout_engine("megatron")(
                model_path=model_path, padded_vocab_size=source.padded_vocab, plan=plan
            )
        self.rollouts[name] = rollout
        self.set_mesh(source.worker_mesh(plan))  # 3D_ALL_MICRO_DP routes by this mesh
        return type(rollout).__name__

    @register("ONE_TO_ALL")
    def sync(
        self, engine: str, rollout: str, t_g: int, kind: str, bucket_bytes: int
    ) -> dict[str, Any]:
        """The 3D-HybridEngine transition into the colocated rollout engine; reports stats
        (``transport``: :func:`count_transport`'s) and the generation mesh."""
        from hf_core.sync import HybridSync

        source = self.engines[engine]
        plan = source.reshard_plan(gen_tp=t_g, kind=kind)
        assert plan == make_plan(source.layout.layout, t_g, kind)
        target = self.rollouts[rollout]
        sync = HybridSync(source, target, bucket_bytes=bucket_bytes, kind=kind, rank=self.rank)
        assert sync.plan == plan  # core builds the same plan from the two engines' layouts
        with count_transport(target) as transport:
            sync.run()
        stats = source.reshard_stats
        self.set_mesh(source.worker_mesh(plan))
        out = stats.as_dict()
        out["recv_units_planned"] = sorted(plan.for_rank(self.rank).recv_units)
        out["transport"] = transport
        return out

    @register("3D_ALL_MICRO_DP")
    def generate(self, batch: Batch, rollout: str, params: dict[str, Any]) -> Batch:
        return self.rollouts[rollout].generate(batch, SamplingParams(**params))

    @register("ONE_TO_ALL")
    def export_hf(self, name: str, path: str) -> str:
        return str(self.engines[name].export_hf(path))
