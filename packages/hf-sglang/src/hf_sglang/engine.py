"""The SGLang rollout engine in hybrid mode: an offline ``sglang.Engine`` owned by the actor.

How SGLang's offline engine runs: ``sglang.Engine(...)`` keeps its tokenizer manager (request
batching, here without a tokenizer: token ids in, token ids out) in the calling process and
starts the model runner -- one scheduler process per TP rank -- as child processes on the same
devices.  In HybridFlow's hybrid placement each actor rank creates one engine after its
training engine, so the rollout model lives in the actor's process tree, on the actor's
devices; weights stream from the training engine's canonical export in buckets, in place
(see :mod:`hf_sglang.weights` for the two transports).  Generation returns exactly the batch
keys of the transformers engine, with per-token log-probs of ``softmax(logits / temperature)``
(see :mod:`hf_sglang.sampling`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.device import resolve_device
from hf_core.engines import (
    NamedTensor,
    RolloutEngine,
    SamplingParams,
    assemble_rollout,
    to_dtype,
)
from hf_core.engines.decoding import expand_prompts, strip_left_padding
from hf_core.engines.hf_folder import check_model_folder, special_tokens
from hf_core.engines.memory import ReleasesTaggedMemory, TaggedMemory
from hf_core.engines.model_classes import refuse_vision_model
from hf_core.engines.process_state import preserve_process_state
from hf_core.sync import RecordsSyncs
from hf_sglang.config import SGLangRolloutConfig, parse_config
from hf_sglang.outputs import pack_outputs
from hf_sglang.runtime import require_sglang
from hf_sglang.sampling import request_params
from hf_sglang.weights import (
    DistributedTransport,
    SGLangSyncStats,
    TensorTransport,
    canonical_shapes,
    check_bucket,
    check_result,
)

log = logging.getLogger(__name__)

CPU_MAX_TOTAL_TOKENS = 16384


def engine_kwargs(cfg: SGLangRolloutConfig, device: str) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for this config and device."""
    kwargs: dict[str, Any] = {
        "model_path": str(cfg.model_path),
        "dtype": cfg.dtype,
        "device": device,
        "tp_size": cfg.tp_size,
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "random_seed": cfg.seed,
        "log_level": cfg.log_level,
    }
    if device == "cpu":
        kwargs["attention_backend"] = cfg.attention_backend or "torch_native"
        kwargs["max_total_tokens"] = cfg.max_total_tokens or CPU_MAX_TOTAL_TOKENS
        kwargs["mem_fraction_static"] = cfg.mem_fraction_static or 0.05
    else:
        kwargs["enable_memory_saver"] = cfg.enable_memory_saver
        optional = {
            "attention_backend": cfg.attention_backend,
            "max_total_tokens": cfg.max_total_tokens,
            "mem_fraction_static": cfg.mem_fraction_static,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
    optional = {
        "max_running_requests": cfg.max_running_requests,
        "context_length": cfg.context_length,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(cfg.engine_kwargs)
    return kwargs


def make_transport(
    engine: Any, cfg: SGLangRolloutConfig, device: str
) -> TensorTransport | DistributedTransport:
    """The weight-sync transport ``cfg.weight_sync`` selects, bound to a running engine."""
    if cfg.weight_sync == "tensor":
        return TensorTransport(engine)
    return DistributedTransport(engine, cfg.sync_group, cfg.tp_size, device)


def weight_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of the weights the engine holds: the canonical shapes (tied aliases once) at
    the engine's dtype -- what its memory saver frees under the ``weights`` tag."""
    return sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize


def kv_cache_bytes(folder: str | Path, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of ``tokens`` token slots: a key and a value vector per layer and
    KV head -- what the memory saver frees under the ``kv_cache`` tag."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder).get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return tokens * config.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


def kv_cache_tokens(engine: Any, kwargs: dict[str, Any]) -> int:
    """The KV cache's size in tokens: ``max_total_tokens`` where configured (always on the
    CPU), else what SGLang sized from ``mem_fraction_static`` at start-up."""
    configured = kwargs.get("max_total_tokens")
    if configured:
        return int(configured)
    return int(engine.get_server_info().get("max_total_num_tokens") or 0)


def memory_tag_bytes(
    folder: str | Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    engine: Any,
    kwargs: dict[str, Any],
) -> dict[str, int]:
    """Bytes under each memory tag (whole engine, all its TP ranks), so release and resume
    report what they free -- or, on the CPU where they free nothing, what they would.
    ``kwargs`` are the engine's (a ``kv_cache_dtype`` of ``fp8*`` counts one byte a value)."""
    kv_dtype = str(kwargs.get("kv_cache_dtype", "auto"))
    kv_cache_dtype = torch.float8_e4m3fn if kv_dtype.startswith("fp8") else dtype
    tokens = kv_cache_tokens(engine, kwargs)
    return {
        "weights": weight_bytes(shapes, dtype),
        "kv_cache": kv_cache_bytes(folder, tokens, kv_cache_dtype),
    }


class SGLangRolloutEngine(RecordsSyncs, ReleasesTaggedMemory, RolloutEngine):
    """``sglang.Engine`` next to the trainer; see the module docstring and the package README."""

    def __init__(self, config: SGLangRolloutConfig | dict[str, Any]) -> None:
        self.config = cfg = parse_config(config)
        folder = check_model_folder(cfg.model_path)
        refuse_vision_model(
            folder,
            "SGLang rollout",
            "its image inputs are not wired here; use rollout.backend=transformers",
        )
        self.device = resolve_device(cfg.device).type  # SGLang takes the device kind
        sglang = require_sglang(self.device)
        tokens = special_tokens(folder)
        self.eos_token_ids, self.pad_token_id = tokens.eos_token_ids, tokens.pad_token_id
        self._shapes = canonical_shapes(folder)

        start = time.perf_counter()
        kwargs = engine_kwargs(cfg, self.device)
        with preserve_process_state():
            self.engine = sglang.Engine(**kwargs)
        self.startup_seconds = time.perf_counter() - start
        self.transport = make_transport(self.engine, cfg, self.device)
        self.weight_version = 0
        self.last_sync: SGLangSyncStats | None = None
        self._sync: SGLangSyncStats | None = None
        tag_bytes = memory_tag_bytes(folder, self._shapes, to_dtype(cfg.dtype), self.engine, kwargs)
        self._memory = TaggedMemory(
            on_gpu=self.device == "cuda",
            tag_bytes=tag_bytes.__getitem__,
            release=lambda tags: self.engine.release_memory_occupation(tags=list(tags)),
            resume=lambda tag: self.engine.resume_memory_occupation(tags=[tag]),
            cpu_note="SGLang's memory saver (torch_memory_saver) needs CUDA; weights and "
            "the KV cache (max_total_tokens) stay allocated during training",
        )
        self._closed = False
        log.info(
            "SGLang engine ready in %.1f s (device=%s, tp=%d, weight_sync=%s)",
            self.startup_seconds,
            self.device,
            cfg.tp_size,
            cfg.weight_sync,
        )

    # ------------------------------------------------------------------ weights
    def _engine_call(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        try:
            result = call(*args, **kwargs)
            check_result(what, result)
            return result
        finally:
            if self._sync is not None:
                self._sync.engine_seconds += time.perf_counter() - now

    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        """Load one bucket of canonical tensors in place (the first bucket opens the sync)."""
        bucket = list(bucket)
        check_bucket(bucket, self._shapes)
        if self._sync is None:
            self._memory.resume("weights")
            self._sync = SGLangSyncStats(transport=self.transport.name)
            self._engine_call("begin_weight_update", self.engine.begin_weight_update)
        self._engine_call(f"{self.transport.name} weight bucket", self.transport.send, bucket)
        self._sync.add(bucket)

    def finish_weight_sync(self) -> None:
        """Close the sync (``end_weight_update``) and flush the radix cache's stale KV."""
        if self._sync is None:  # nothing was sent: still drop cached KV, as promised
            self._sync = SGLangSyncStats(transport=self.transport.name)
        else:
            self._engine_call("end_weight_update", self.engine.end_weight_update)
        self._engine_call("flush_cache", self.engine.flush_cache)
        sync, self._sync = self._sync, None
        sync.finish()
        self.last_sync = sync
        self.weight_version += 1
        log.debug("weight sync %d: %s", self.weight_version, sync)

    # --------------------------------------------------------------- generation
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt (consecutive rows), right-padded to
        ``max_new_tokens`` so batches from different ranks concatenate."""
        batch = expand_prompts(prompts, params)
        if self.memory_released:
            self.resume_memory()
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        token_lists = strip_left_padding(prompt_ids, prompt_mask) if len(batch) else []
        requests = request_params(
            params,
            len(token_lists),
            stop_token_ids=(*params.stop_token_ids, *self.eos_token_ids),
            ignore_eos=self.config.ignore_eos,
        )
        outputs = (
            self.engine.generate(
                input_ids=token_lists, sampling_params=requests, return_logprob=True
            )
            if token_lists
            else []
        )
        responses, log_probs, response_mask = pack_outputs(
            outputs, params.max_new_tokens, self.pad_token_id, prompt_ids.dtype
        )
        return assemble_rollout(batch, responses, response_mask, log_probs, params.temperature)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Leave the sync group and stop SGLang's processes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.transport.close()
        finally:
            self.engine.shutdown()
