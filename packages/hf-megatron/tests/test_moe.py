"""Mixture-of-experts (Qwen3-MoE) on the megatron engine: the weight mapping against
transformers, expert parallelism against one rank, the per-expert export, routing replay.

Each test runs its ranks as fresh processes (``torch.multiprocessing`` + gloo): megatron keeps
its process groups in module globals, and a new ``ep`` needs new groups.  References are
plain transformers, independent of hf_megatron's code.
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_core.batch import Batch
from hf_testing.conformance.reference import hf_log_probs_and_entropy
from hf_testing.tiny import build_tiny_model
from hf_testing.workers import policy_loss, rollout_batch

B, P, R = 4, 6, 7


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, *args)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, tmp: Path) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` fresh gloo ranks; every rank's result."""
    out = str(tmp / f"result_{time.monotonic_ns()}")
    mp.spawn(_rank_main, args=(world, _free_port(), fn, args, out), nprocs=world)
    results = []
    for rank in range(world):
        with open(f"{out}.{rank}", "rb") as f:
            results.append(pickle.load(f))
    return results


def _engine(path: Path, **extra: Any) -> Any:
    from hf_megatron.engine import MegatronEngine

    return MegatronEngine({"model_path": str(path), "seed": 0, **extra})


def _vocab(path: Path) -> int:
    return int(AutoConfig.from_pretrained(path).vocab_size)


def _gradients(engine: Any, batch: Batch) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One forward/backward of ``batch`` (this rank's share) with the policy loss, through
    megatron's schedule and its gradient reduction (``finalize_model_grads``); the losses of
    the micro-batches and this rank's gradients under their canonical names (an EP rank:
    its own experts' only)."""
    from hf_megatron import _cpu_compat as cpu_compat

    with cpu_compat.cpu_device_mode():
        micro = engine._micro_batches(batch)
        meta = engine._loss_meta(batch, len(micro))
        for i, mb in enumerate(micro):
            mb.meta.update(meta, micro_batch_index=i, micro_batch_size=len(mb))
        engine.model.train()
        engine._ddp.zero_grad_buffer()
        results = engine._run(micro, loss_fn=policy_loss, temperature=1.0)
    native = {n: p.main_grad.detach().clone() for n, p in engine.module.named_parameters()}
    grads = {s.name: s.tensor for s in engine.mapping.canonical_pieces(native)}
    return [float(r["loss"]) for r in results], grads


# ---------------------------------------------------------------- (a) ep=2 equals ep=1


def _train_once(rank: int, path: Path, batch: Batch) -> dict[int, dict[str, Any]]:
    """ep=1, then ep=2 in the same two processes (megatron's groups are re-initialised for
    the second engine; the first is not used after it)."""
    out = {}
    for ep in (1, 2):
        # all-reduced gradients on every rank (the distributed optimizer reduce-scatters them)
        engine = _engine(
            path, expert_parallel_size=ep, micro_batch_size=1, use_distributed_optimizer=False
        )
        assert engine.position.ep_size == ep and engine.layout.dp == 2
        mine = batch.split(len(batch) // 2)[rank]  # the data-parallel split (dp = 2 either way)
        losses, grads = _gradients(engine, mine)
        out[ep] = {"losses": losses, "grads": grads, "experts": engine.mapping.native_shapes()}
    return out


def test_expert_parallel_equals_one_rank_per_expert_set(moe_model: Path, tmp_path: Path) -> None:
    """ep=2 (each rank holds 2 of the 4 experts) against ep=1 (every rank holds all four) on
    the same two data-parallel ranks and batch: losses and every gradient agree."""
    batch = rollout_batch(B, P, R, _vocab(moe_model), seed=5)
    start = time.perf_counter()
    runs = run_ranks(2, _train_once, moe_model, batch, tmp=tmp_path)
    print(f"ep=1 and ep=2 on two ranks: {time.perf_counter() - start:.1f} s")
    ep1, ep2 = [run[1] for run in runs], [run[2] for run in runs]
    local = [name for name in ep2[0]["experts"] if ".local_experts." in name]
    assert len(local) == 2 * 2 * 2  # layers x local experts x (fc1, fc2): half the experts
    for rank in range(2):
        assert ep1[rank]["losses"] == pytest.approx(ep2[rank]["losses"], abs=1e-5)
    reference = ep1[0]["grads"]
    assert all(torch.equal(reference[n], ep1[1]["grads"][n]) for n in reference)
    merged: dict[str, torch.Tensor] = {}
    for rank in range(2):
        for name, grad in ep2[rank]["grads"].items():
            if name in merged and ".experts." not in name:
                assert torch.allclose(merged[name], grad, atol=1e-6), name  # DP replicas agree
            merged[name] = grad
    assert merged.keys() == reference.keys()
    expert_grads = [n for n in reference if ".experts." in n]
    assert expert_grads and any(float(reference[n].abs().max()) > 0 for n in expert_grads)
    for name, grad in reference.items():
        assert float((merged[name] - grad).abs().max()) <= 1e-5, name


# ---------------------------------------------------------------- (b) log-probs vs transformers


def _log_probs(rank: int, path: Path, batch: Batch) -> Batch:
    engine = _engine(path, trainable=False, micro_batch_size=2)
    return engine.compute_log_probs(batch, temperature=0.7)


def test_log_probs_equal_transformers(moe_model: Path, tmp_path: Path) -> None:
    batch = rollout_batch(B, P, R, _vocab(moe_model), seed=3)
    (out,) = run_ranks(1, _log_probs, moe_model, batch, tmp=tmp_path)
    expected, entropy = hf_log_probs_and_entropy(
        AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32), batch, 0.7
    )
    mask = batch["response_mask"]
    assert float(((out["log_probs"] - expected) * mask).abs().max()) < 1e-4
    assert float(((out["entropy"] - entropy) * mask).abs().max()) < 1e-4


# ---------------------------------------------------------------- (c) export round trip


def _export(rank: int, path: Path, tp: int, ep: int, batch: Batch) -> dict[str, Any]:
    from hf_megatron.reshard import expert_bytes_per_rank

    engine = _engine(
        path, trainable=False, tensor_parallel_size=tp, expert_parallel_size=ep, micro_batch_size=2
    )
    tensors = {n: t.clone() for bucket in engine.export_weights(1 << 14) for n, t in bucket}
    assert engine.reshard_stats is not None
    dp = engine.layout.coords.dp  # the data-parallel share of the batch (ep splits dp)
    mine = batch.split(len(batch) // engine.layout.dp)[dp]
    return {
        "tensors": tensors,
        "stats": engine.reshard_stats.as_dict(),
        "figure": expert_bytes_per_rank(engine.dims, ep, 4, tp),
        "dp": dp,
        "log_probs": engine.compute_log_probs(mine, temperature=0.7)["log_probs"],
    }


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 2)])  # ep=1: the conformance kit's
def test_export_is_the_checkpoint_per_expert(
    moe_model: Path, tmp_path: Path, tp: int, ep: int
) -> None:
    """Every rank's export (whole tensors: one generation rank per training rank) is the
    checkpoint, per expert; under ep the experts' bytes each rank sends and receives are the
    plan's figure (its own experts once, every other rank's once); and each data-parallel
    rank's log-probs of its share of a batch are transformers' (the token dispatcher)."""
    state = load_file(moe_model / "model.safetensors")
    expert_bytes = sum(t.numel() * 4 for n, t in state.items() if ".mlp.experts." in n)
    group = tp * ep
    batch = rollout_batch(B, P, R, _vocab(moe_model), seed=3)
    expected, _ = hf_log_probs_and_entropy(
        AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32), batch, 0.7
    )
    shares = list(zip(expected.split(B // ep), batch["response_mask"].split(B // ep), strict=True))
    for out in run_ranks(tp * ep, _export, moe_model, tp, ep, batch, tmp=tmp_path):
        exported, stats, (sent, received) = out["tensors"], out["stats"], out["figure"]
        want, mask = shares[out["dp"]]
        assert float(((out["log_probs"] - want) * mask).abs().max()) < 1e-4
        assert (sent, received) == (expert_bytes // group, expert_bytes * (group - 1) // group)
        if ep > 1:
            assert stats["expert_sent_bytes"] == sent
            assert stats["expert_received_bytes"] == received
        assert exported.keys() == state.keys()
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
        for name, tensor in state.items():
            assert torch.equal(exported[name], tensor), name


# ---------------------------------------------------------------- (d) routing replay


def _hf_routing(path: Path, batch: Batch) -> torch.Tensor:
    """transformers' own top-k ids of every token and MoE layer, laid out as ``input_ids``
    (``[rows, columns, layers, k]``, uint8; padding unrecorded): what a rollout records."""
    from hf_core.engines.routed_experts import unrecorded

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda _m, _a, out: seen.append(out[2])) for r in routers]
    rows, cols = batch["input_ids"].shape
    with torch.no_grad():
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
    for handle in handles:
        handle.remove()
    routed = torch.stack([ids.reshape(rows, cols, -1) for ids in seen], dim=2).to(torch.uint8)
    pad = batch["attention_mask"] == 0
    routed[pad] = unrecorded(torch.uint8)
    return routed


def _replay_run(rank: int, path: Path, batch: Batch) -> dict[str, Any]:
    from hf_megatron import moe_routing

    engine = _engine(path, micro_batch_size=len(batch), lr=1e-2, grad_clip=None)
    ran: list[torch.Tensor] = []
    original = moe_routing._Replay.get_replay_topk

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        ran.append(out[1].detach().clone())
        return out

    moe_routing._Replay.get_replay_topk = spy  # type: ignore[method-assign]
    free = batch.select(*[k for k in batch.keys() if k != "routed_experts"])
    out: dict[str, Any] = {}
    unrecorded = batch.select(*batch.keys())
    unrecorded["routed_experts"] = torch.full_like(batch["routed_experts"], 255)
    out["plain"] = engine.compute_log_probs(free)["log_probs"]
    out["replayed"] = engine.compute_log_probs(batch)["log_probs"]
    ran.clear()
    engine.compute_log_probs(unrecorded)
    out["ran_own"] = list(ran)  # the model's own choice (nothing recorded)
    ran.clear()
    # the router changed: its own choice differs from the recorded one
    routers = moe_routing.moe_routers(engine.module)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for router in routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * 3.0)
    before = [r.weight.detach().clone() for r in routers]
    engine.compute_log_probs(unrecorded)
    out["ran_free"] = list(ran)  # the perturbed router's own choice (nothing recorded)
    ran.clear()
    out["metrics"] = engine.train_step(batch, policy_loss)
    weighted = functools.partial(policy_loss)
    weighted.algo = types.SimpleNamespace(moe_aux_loss_coef=0.01)  # type: ignore[attr-defined]
    try:
        engine.train_step(batch, weighted)
        out["router_loss_refusal"] = ""
    except NotImplementedError as exc:
        out["router_loss_refusal"] = str(exc)
    out["ran_replayed"] = list(ran)
    out["router_moved"] = [
        float((r.weight.detach() - b).abs().max()) for r, b in zip(routers, before, strict=True)
    ]
    return out


def test_replay_runs_the_recorded_experts(moe_model: Path, tmp_path: Path) -> None:
    from hf_core.engines.routed_experts import recorded_mask
    from hf_megatron.forward import pack_left
    from hf_megatron.moe_routing import packed_routing, real_tokens

    batch = rollout_batch(B, P, R, _vocab(moe_model), seed=9)
    routed = _hf_routing(moe_model, batch)
    batch["routed_experts"] = routed
    (out,) = run_ranks(1, _replay_run, moe_model, batch, tmp=tmp_path)
    _, shift, lengths = pack_left(batch["input_ids"], batch["attention_mask"])
    expected = packed_routing(routed, shift)  # [tokens, layers, k], megatron's order
    real = real_tokens(lengths, routed.shape[1]) & recorded_mask(expected).all(-1).all(-1)
    assert int(real.sum()) > 20
    layers = routed.shape[2]

    def sets(ids: torch.Tensor) -> torch.Tensor:
        return ids.sort(-1).values

    # the unchanged model: transformers' routing is megatron's own (token order, mapping),
    # and replaying it changes no log-prob
    for layer in range(layers):
        own = out["ran_own"][layer]
        assert torch.equal(sets(own[real]), sets(expected[real, layer].long()))
    mask = batch["response_mask"]
    assert float(((out["plain"] - out["replayed"]) * mask).abs().max()) < 1e-5
    # the router perturbed: without a record it picks other experts (control) ...
    differs = [
        not torch.equal(sets(out["ran_free"][layer][real]), sets(expected[real, layer].long()))
        for layer in range(layers)
    ]
    assert any(differs)
    # ... and with the record every real token runs the recorded experts
    for layer in range(layers):
        ran = out["ran_replayed"][layer]
        assert torch.equal(sets(ran[real]), sets(expected[real, layer].long()))
    metrics = out["metrics"]
    assert 0.0 <= metrics["moe/router_agreement"] < 1.0
    assert metrics["moe/expert_load_max_over_mean"] >= 1.0
    assert all(moved > 0 for moved in out["router_moved"])  # the router still learns
    assert "algorithm.moe_aux_loss_coef" in out["router_loss_refusal"]  # not silently ignored


# ---------------------------------------------------------------- the mapping, pure tensors


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 4)])
def test_every_expert_round_trips_through_its_rank(
    moe_model: Path, tp: int, pp: int, ep: int
) -> None:
    """Every (tp, pp, ep) rank loads its experts' slices; together the ranks' canonical pieces
    are the checkpoint exactly, each expert held by one expert-parallel rank only."""
    from hf_megatron.weight_mapping import (
        MegatronWeightMapping,
        ModelDims,
        RankPosition,
        fetch_from,
        local_experts,
    )

    state = load_file(moe_model / "model.safetensors")
    dims = ModelDims.from_hf(AutoConfig.from_pretrained(moe_model), "lm")
    assert (dims.num_experts, dims.moe_topk, dims.qk_norm) == (4, 2, True)
    padded = dims.padded_vocab(tp)
    back = {n: torch.full_like(t, float("nan")) for n, t in state.items()}
    for stage in range(pp):
        for t in range(tp):
            for e in range(ep):
                pos = RankPosition(t, tp, stage, pp, e, ep)
                assert len(local_experts(dims, pos)) == dims.num_experts // ep
                mapping = MegatronWeightMapping(dims, pos, padded)
                native = dict(mapping.load(fetch_from(state)))
                experts = {n for n in native if ".local_experts." in n}
                assert len(experts) == 2 * (dims.num_layers // pp) * (dims.num_experts // ep)
                for piece in mapping.canonical_pieces(native):
                    target = back[piece.name]
                    if piece.dim is None:
                        target.copy_(piece.tensor)
                    else:
                        width = piece.tensor.shape[piece.dim]
                        target.narrow(piece.dim, piece.start, width).copy_(piece.tensor)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
