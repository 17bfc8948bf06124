"""A torchrun job for the GPU tests: nccl, Transformer Engine spec (when installed), bf16.

Usage: torchrun --nproc-per-node N megatron_gpu_job.py MODEL_DIR OUT_DIR
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
    from megatron_test_workers import make_plan, policy_loss, rollout_batch

    from hf_megatron.engine import MegatronEngine
    from hf_megatron.model import have_transformer_engine

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, object] = {"backend": dist.get_backend(), "world": world}
    results["have_te"] = have_transformer_engine()

    engine = MegatronEngine(
        {
            "model_path": model_path,
            "tensor_parallel_size": world,
            "param_dtype": "bfloat16",
            "lr": 1e-3,
            "micro_batch_size": 2,
        }
    )
    results["device"] = str(engine.device)
    results["spec"] = engine.spec_kind
    results["param_dtype"] = str(next(engine.module.parameters()).dtype)
    batch = rollout_batch(4, 5, 6, 128, seed=1)
    results["batch"] = batch
    results["log_probs"] = engine.compute_log_probs(batch)["log_probs"].cpu()
    results["metrics"] = engine.train_step(batch, policy_loss)

    plan = make_plan(engine.layout.layout, 1, "hybrid")
    names = [s.name for bucket in engine.export_slices(1 << 20, plan) for s in bucket]
    results["exported"] = len(names)
    results["received_fraction"] = engine.last_reshard.received_fraction

    torch.cuda.synchronize()
    results["mem_trained"] = torch.cuda.memory_allocated()
    engine.offload()
    results["mem_offloaded"] = torch.cuda.memory_allocated()
    try:
        engine.compute_log_probs(batch)
        results["offloaded_error"] = None
    except RuntimeError as exc:
        results["offloaded_error"] = str(exc)
    engine.onload()
    results["mem_onloaded"] = torch.cuda.memory_allocated()
    results["metrics_after_onload"] = engine.train_step(batch, policy_loss)

    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
