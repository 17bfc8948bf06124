"""LoRA against full fine-tuning on the FSDP engine: bytes per weight sync and peak memory.

    python bench/lora_sync.py [--hidden 512 --layers 8 --rank 8] [--vllm] [--write]

Each mode runs on 2 ranks (gloo, CPU, one thread each) in fresh processes: build the FSDP
actor, run 2 training steps (the first allocates AdamW's state), then 3 weight syncs through
core's sync path (:func:`hf_core.sync.weight_sync_for`) into the transformers rollout engine,
and with ``--vllm`` into a vLLM engine that serves LoRA (``max_lora_rank``; adapters only).

Memory: peak RSS during the training steps minus RSS before them (the optimiser state and
gradients that training adds), and the bytes of trainable parameters, gradients and optimiser
state counted from the tensors (this rank's shards).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import (
    MIB,
    init_gloo,
    machine_line,
    peak_extra,
    pin_mmap_threshold,
    run_ranks,
    training_bench_model,
    write_section,
)

TITLE = "## LoRA vs full fine-tuning: bytes per sync and peak memory (`bench/lora_sync.py`)"
MODES = ("full", "lora")


def _state_bytes(engine: object) -> dict[str, int]:
    import torch

    from hf_fsdp.engine import FSDPEngine

    assert isinstance(engine, FSDPEngine)

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for p in engine.model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    optim = engine.optimizer
    assert optim is not None
    state = sum(
        local(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return {
        "param_bytes": sum(local(p) for p in params),
        "trainable_params": sum(p.numel() for p in trainable),
        "grad_bytes": sum(local(p) for p in trainable),
        "optimizer_bytes": state,
    }


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict:
    import torch

    from hf_core.engines import SamplingParams
    from hf_core.sync import weight_sync_for
    from hf_fsdp.engine import FSDPEngine
    from hf_fsdp.rollout import TransformersRolloutEngine
    from hf_testing.workers import policy_loss, rollout_batch

    init_gloo(rank, world, port)
    config: dict = {"model_path": args.model, "lr": 1e-3, "micro_batch_size": 8}
    if args.mode == "lora":
        config["lora"] = {"rank": args.rank, "alpha": 2.0 * args.rank}
    engine = FSDPEngine(config)
    vocab = engine.hf_config.vocab_size
    gc.collect()
    with peak_extra() as train_peak:
        for step in range(2):
            engine.train_step(rollout_batch(8, 16, 16, vocab, seed=rank * 10 + step), policy_loss)
    result = {"train_peak_extra": train_peak["bytes"], **_state_bytes(engine)}

    rollout = TransformersRolloutEngine({"model_path": args.model})
    sync = weight_sync_for(engine, rollout, bucket_bytes=64 * MIB, kind="hybrid", rank=rank)
    rows = [sync.run() for _ in range(3)]
    result["hf_seconds"] = statistics.median(r["perf/weight_sync_s"] for r in rows)
    result["hf_bytes"] = sum(
        t.numel() * t.element_size() for b in engine.export_weights(64 * MIB) for _, t in b
    )
    if "lora/sync_bytes" in rows[-1]:
        result["hf_bytes"] = int(rows[-1]["lora/sync_bytes"])
    del rollout

    if args.vllm and args.mode == "lora":
        from hf_vllm.engine import VLLMRolloutEngine

        vllm_engine = VLLMRolloutEngine(
            {
                "model_path": args.model,
                "max_lora_rank": max(8, args.rank),
                "kv_cache_bytes": 64 * MIB,
            }
        )
        sync = weight_sync_for(engine, vllm_engine, bucket_bytes=64 * MIB, kind="hybrid", rank=rank)
        rows = []
        for _ in range(3):
            rows.append(sync.run())
            vllm_engine.generate(  # vLLM loads the new adapter here: count it with the sync
                rollout_batch(2, 4, 1, vocab, seed=0).select("input_ids", "attention_mask"),
                SamplingParams(max_new_tokens=1),
            )
        result["vllm_seconds"] = statistics.median(r["perf/weight_sync_s"] for r in rows)
        result["vllm_bytes"] = int(rows[-1]["lora/sync_bytes"])
        assert rows[-1]["lora/adapters_only"] == 1.0
    torch.distributed.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--vllm", action="store_true", help="also sync LoRA into vLLM")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    # vLLM on CPU: a small KV cache, the engine in this process (the rank processes inherit)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    pin_mmap_threshold()
    results: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.model = training_bench_model(Path(tmp) / "model", args.hidden, args.layers)
        for mode in MODES:
            args.mode = mode
            start = time.perf_counter()
            results[mode] = run_ranks(rank_main, args.world, args)
            print(mode, f"{time.perf_counter() - start:.1f} s", results[mode][0], flush=True)
    section = render(results, args)
    print(section)
    if args.write:
        print("wrote", write_section(TITLE, section))


def render(results: dict[str, dict[int, dict]], args: argparse.Namespace) -> str:
    def mib(value: float) -> str:
        return f"{value / MIB:.2f}"

    full, lora = results["full"][0], results["lora"][0]
    worst = {m: max(r["train_peak_extra"] for r in results[m].values()) for m in MODES}
    lines = [
        TITLE,
        "",
        f"Model: tiny Qwen2, hidden {args.hidden}, {args.layers} layers; LoRA rank {args.rank}, "
        f"alpha {2 * args.rank}, on q/k/v/o/gate/up/down.  {args.world} ranks (gloo, CPU, 1 "
        "thread each), FSDP2, float32, AdamW; 2 training steps of 8 x (16 + 16) tokens per "
        "rank, then 3 syncs (median seconds).  Bytes are per rank (rank 0 shown; ranks "
        "agree).  Peak extra RSS = peak RSS during the 2 training steps minus RSS before them "
        "(activations, gradients, AdamW state).  Reproduce: `python bench/lora_sync.py --vllm "
        "--write` in the vllm session's venv.",
        "",
        machine_line(load=True),
        "",
        "| | full fine-tuning | LoRA | LoRA / full |",
        "|---|---|---|---|",
        f"| trainable parameters | {full['trainable_params']:,} | {lora['trainable_params']:,} "
        f"| {lora['trainable_params'] / full['trainable_params']:.4f} |",
        f"| parameter shards MiB | {mib(full['param_bytes'])} | {mib(lora['param_bytes'])} | "
        f"{lora['param_bytes'] / full['param_bytes']:.3f} |",
        f"| gradient shards MiB | {mib(full['grad_bytes'])} | {mib(lora['grad_bytes'])} | "
        f"{lora['grad_bytes'] / full['grad_bytes']:.4f} |",
        f"| AdamW state MiB | {mib(full['optimizer_bytes'])} | {mib(lora['optimizer_bytes'])} "
        f"| {lora['optimizer_bytes'] / full['optimizer_bytes']:.4f} |",
        f"| peak extra RSS in training MiB (worst rank) | {mib(worst['full'])} | "
        f"{mib(worst['lora'])} | {worst['lora'] / max(worst['full'], 1):.3f} |",
        f"| bytes per sync into transformers engine MiB (LoRA: merged) | {mib(full['hf_bytes'])} | "
        f"{mib(lora['hf_bytes'])} | {lora['hf_bytes'] / full['hf_bytes']:.3f} |",
        f"| sync into transformers engine s | {full['hf_seconds']:.3f} | "
        f"{lora['hf_seconds']:.3f} | "
        f"{lora['hf_seconds'] / full['hf_seconds']:.2f} |",
    ]
    if "vllm_bytes" in lora:
        lines += [
            f"| bytes per sync into vLLM MiB (full: the model; LoRA: adapters only) | "
            f"{mib(full['hf_bytes'])} "
            f"| {mib(lora['vllm_bytes'])} | {lora['vllm_bytes'] / full['hf_bytes']:.4f} |",
            f"| sync into vLLM s (LoRA: gather + peft folder written; vLLM reads it at the "
            f"next generate, not timed) | - | {lora['vllm_seconds']:.3f} | - |",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
