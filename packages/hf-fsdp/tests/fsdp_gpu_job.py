"""A torchrun job for the GPU tests: FSDP engine with nccl, bf16 compute, offload/onload.

Usage: torchrun --nproc-per-node N fsdp_gpu_job.py MODEL_DIR OUT_DIR
Each rank writes ``OUT_DIR/rank{r}.pt`` with what the test asserts on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(model_path: str, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from fsdp_test_workers import policy_loss, rollout_batch

    from hf_fsdp.engine import FSDPEngine

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, object] = {"backend": dist.get_backend(), "world": world}

    engine = FSDPEngine({"model_path": model_path, "lr": 1e-3, "micro_batch_size": 2})
    results["device"] = str(engine.device)
    results["master_dtype"] = str(next(engine.model.parameters()).dtype)
    batch = rollout_batch(4 * world, 5, 6, 128, seed=1).chunk(world)[rank]
    results["batch"] = batch
    results["log_probs"] = engine.compute_log_probs(batch)["log_probs"]
    results["metrics"] = engine.train_step(batch, policy_loss)

    torch.cuda.synchronize()
    results["mem_trained"] = torch.cuda.memory_allocated()
    engine.offload()
    results["mem_offloaded"] = torch.cuda.memory_allocated()
    results["shard_devices_offloaded"] = sorted(
        {str(p.to_local().device) for p in engine.model.parameters()}
    )
    try:
        engine.compute_log_probs(batch)
        results["offloaded_forward_error"] = None
    except RuntimeError as exc:
        results["offloaded_forward_error"] = str(exc)
    engine.onload()
    results["mem_onloaded"] = torch.cuda.memory_allocated()
    results["metrics_after_onload"] = engine.train_step(batch, policy_loss)

    # FSDP2's own CPU offload policy: shards in host memory, gathered to the GPU for compute.
    host = FSDPEngine({"model_path": model_path, "cpu_offload": True, "trainable": False})
    results["host_shard_devices"] = sorted(
        {str(p.to_local().device) for p in host.model.parameters()}
    )
    results["host_log_probs"] = host.compute_log_probs(batch)["log_probs"]
    names = [n for bucket in host.export_weights(1 << 16) for n, _ in bucket]
    results["host_exported"] = len(names)

    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
