"""A torchrun job for the GPU tests: FSDP engine with nccl, bf16 compute, offload/onload.

Usage: torchrun --nproc-per-node N fsdp_gpu_job.py MODEL_DIR OUT_DIR
Each rank writes ``OUT_DIR/rank{r}.pt`` with what the test asserts on.
"""

from __future__ import annotations

import sys

from hf_testing.gpu import finish_nccl_job, offload_round_trip, start_nccl_job
from hf_testing.workers import policy_loss, rollout_batch


def main(model_path: str, out_dir: str) -> None:
    from hf_fsdp.engine import FSDPEngine

    rank, world, results = start_nccl_job()
    engine = FSDPEngine({"model_path": model_path, "lr": 1e-3, "micro_batch_size": 2})
    results["device"] = str(engine.device)
    results["master_dtype"] = str(next(engine.model.parameters()).dtype)
    batch = rollout_batch(4 * world, 5, 6, 128, seed=1).chunk(world)[rank]
    results["batch"] = batch
    results["log_probs"] = engine.compute_log_probs(batch)["log_probs"]
    results["metrics"] = engine.train_step(batch, policy_loss)

    def shard_devices() -> dict[str, list[str]]:
        devices = {str(p.to_local().device) for p in engine.model.parameters()}
        return {"shard_devices_offloaded": sorted(devices)}

    results |= offload_round_trip(engine, batch, policy_loss, while_offloaded=shard_devices)

    # FSDP2's own CPU offload policy: shards in host memory, gathered to the GPU for compute.
    host = FSDPEngine({"model_path": model_path, "cpu_offload": True, "trainable": False})
    results["host_shard_devices"] = sorted(
        {str(p.to_local().device) for p in host.model.parameters()}
    )
    results["host_log_probs"] = host.compute_log_probs(batch)["log_probs"]
    names = [n for bucket in host.export_weights(1 << 16) for n, _ in bucket]
    results["host_exported"] = len(names)
    finish_nccl_job(results, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
