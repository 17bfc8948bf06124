"""A worker the kernel's out-of-memory killer ended: what to tell the user instead of
restarting.

A restart resumes from the latest checkpoint and replays the same steps with the same data,
so a step that ran a process out of memory would do so again: the run ends with the stage
that died, the peak memory that stage last reached (the step before, every rank's largest)
and the settings that lower it.
"""

from __future__ import annotations

from hf_core.runtime import WorkerLostError

LOWER_IT = {
    "update_actor": "actor.engine.micro_batch_size or max_tokens_per_micro_batch (smaller "
    "micro-batches), actor.engine.gradient_checkpointing: true",
    "update_critic": "critic.engine.micro_batch_size or max_tokens_per_micro_batch, "
    "critic.engine.gradient_checkpointing: true",
    "generate": "rollout.engine.max_batch_size (sequences decoded together), "
    "rollout.max_new_tokens",
    "compute_log_probs": "actor.engine.micro_batch_size or max_tokens_per_micro_batch",
    "compute_ref_log_probs": "actor.engine.micro_batch_size or max_tokens_per_micro_batch",
}
"""Per worker method (the stage that died): the settings that lower its peak memory."""

EVERY_STAGE = "fewer samples per step (data.batch_size x rollout.n), or more processes"


def out_of_memory_error(lost: WorkerLostError, last_metrics: dict[str, float]) -> WorkerLostError:
    """``lost`` with the stage's last measured peak and the settings that lower it."""
    peak = last_metrics.get(f"memory/{lost.method}_peak_gib")
    measured = (
        f"that stage peaked at {peak:.2f} GiB on its largest rank in the last logged step"
        if peak is not None
        else "no step had completed it yet"
    )
    lower = LOWER_IT.get(lost.method)
    advice = f"{lower}; or {EVERY_STAGE}" if lower else EVERY_STAGE
    reason = (
        f"{lost.reason}; out of memory in {lost.method!r}: {measured}. Not restarted: resuming "
        f"would run the same step out of memory again. To lower it: {advice}"
    )
    return WorkerLostError(
        lost.role, lost.rank, lost.method, reason, lost.stacks_dir, out_of_memory=True
    )
