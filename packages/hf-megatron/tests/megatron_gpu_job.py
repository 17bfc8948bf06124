"""A torchrun job for the GPU tests: nccl, Transformer Engine spec (when installed), bf16.

Usage: torchrun --nproc-per-node N megatron_gpu_job.py MODEL_DIR OUT_DIR
Each rank writes ``OUT_DIR/rank{r}.pt`` with what the test asserts on.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_testing.gpu import finish_nccl_job, offload_round_trip, start_nccl_job
from hf_testing.workers import policy_loss, rollout_batch


def main(model_path: str, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from megatron_test_workers import make_plan

    from hf_megatron.engine import MegatronEngine
    from hf_megatron.model import have_transformer_engine

    rank, world, results = start_nccl_job()
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
    results["received_fraction"] = engine.reshard_stats.received_fraction
    results |= offload_round_trip(engine, batch, policy_loss)
    finish_nccl_job(results, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
