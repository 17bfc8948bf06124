"""Where a vLLM engine sits among the training ranks (generation TP and DP in hybrid mode).

Inside a training group every rank builds its engine with vLLM's ``external_launcher``
executor, which joins the process group the trainer already made instead of spawning
workers.  ``tensor_parallel_size`` (t_g) ranks, consecutive in rank order, form one engine;
the world splits into ``world / t_g`` generation replicas (micro-DP).  The ranks of one engine
run SPMD: each calls ``generate`` with the same prompts at the same time and gets the same
tokens.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hf_core.engines import GenerationRank
from hf_vllm.config import VLLMRolloutConfig


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_executor(cfg: VLLMRolloutConfig) -> str:
    """``external_launcher`` inside a torch.distributed group, ``uni`` in a lone process."""
    backend = cfg.distributed_executor_backend
    if backend == "auto":
        backend = "external_launcher" if _distributed() else "uni"
    tp = cfg.tensor_parallel_size
    if backend == "external_launcher":
        if not _distributed():
            raise RuntimeError(
                "distributed_executor_backend='external_launcher' needs torch.distributed "
                "initialised on every rank first (a HybridFlow worker group or torchrun does it)"
            )
        world = dist.get_world_size()
        if world % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the training world size {world}"
            )
    elif tp > 1:
        raise ValueError(
            f"tensor_parallel_size={tp} in hybrid mode needs the engine inside a "
            "torch.distributed group of a multiple of that many ranks (external_launcher)"
        )
    return backend


@contextmanager
def launcher_env(backend: str) -> Iterator[None]:
    """The variables ``external_launcher`` reads, made consistent with the live group.

    ``LOCAL_RANK`` picks the CUDA device vLLM uses: under Ray each rank sees only its own GPU
    (device 0) whatever its local rank, so it is set to the current device while the engine
    is built and restored afterwards.
    """
    if backend != "external_launcher":
        yield
        return
    wanted = {"RANK": str(dist.get_rank()), "WORLD_SIZE": str(dist.get_world_size())}
    wanted["LOCAL_RANK"] = (
        str(torch.cuda.current_device())
        if torch.cuda.is_available()
        else os.environ.get("LOCAL_RANK", "0")
    )
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_generation_rank(backend: str) -> GenerationRank:
    """This rank's place in the generation mesh vLLM actually built (its TP group), not what
    we asked for."""
    if backend != "external_launcher":
        return GenerationRank()
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    ranks = list(group.ranks)
    tp = len(ranks)
    rank = dist.get_rank()
    if ranks != list(range(ranks[0], ranks[0] + tp)) or ranks[0] % tp:
        raise RuntimeError(f"unexpected vLLM tensor-parallel group {ranks} for rank {rank}")
    return GenerationRank(
        dp_rank=rank // tp,
        dp_size=dist.get_world_size() // tp,
        tp_rank=ranks.index(rank),
        tp_size=tp,
    )


def prompts_digest(input_ids: torch.Tensor, attention_mask: torch.Tensor, *extra: object) -> str:
    """A short fingerprint of a generate call (prompt tensors + sampling settings)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (input_ids, attention_mask):
        digest.update(repr((tensor.dtype, tuple(tensor.shape))).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    digest.update(repr(extra).encode())
    return digest.hexdigest()


def check_lockstep(digest: str, place: GenerationRank) -> None:
    """Fail fast when the ranks of one TP engine were given different work.

    Each rank of an ``external_launcher`` engine schedules on its own; different prompts would
    make their collectives disagree (a hang, or silently wrong tokens).
    """
    if place.tp_size == 1:
        return
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    seen: list[str | None] = [None] * place.tp_size
    dist.all_gather_object(seen, digest, group=group.cpu_group)
    if len(set(seen)) != 1:
        raise RuntimeError(
            f"the {place.tp_size} ranks of tensor-parallel engine {place.dp_rank} were given "
            "different prompts or sampling settings; dispatch generate with 3D_ALL_MICRO_DP "
            "(one chunk per generation replica, the same chunk on each of its TP ranks)"
        )
