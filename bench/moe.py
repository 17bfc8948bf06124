"""Mixture-of-experts GRPO at the Qwen3-30B-A3B router (128 experts, top-8), ~300M parameters.

The model is ``hf_testing.real_shapes``' ``qwen3-30b-a3b-scaled`` (4 layers of width 512, the
real router and vocabulary; random weights) in bfloat16.  Two parts, both on 2 processes
(FSDP2 shards, the standard weight sync):

* **Replay.** The bare engines: each rank's transformers rollout engine samples its share of
  the prompts, recording each fed token's experts; the FSDP engine then recomputes the
  sampled tokens' log-probs with routing replay off and on.  Per setting: the mean and max
  |log-prob difference| against the rollout's own log-probs, and the router agreement -- the
  share of (token, MoE layer) top-k sets of the training forward equal to the rollout's (off:
  the training router's own choice; on: the experts the replayed forward ran, read back from
  the routers).  Plus the routing data's bytes per token and per step, the weight sync's
  seconds and bytes per rank against the plan's figure, and each process's peak RSS.
* **Steps.** ``hybridflow run`` of the GRPO recipe (FSDP -> transformers) with
  ``algorithm.router_replay`` off and on: seconds per stage, the step against its in-process
  floor (the bare engines' generate + train_step of the same batch, ``bench/scale.py``'s),
  sync seconds, routing bytes, peak RSS per process, the trainer's own mismatch metric.

    python bench/moe.py                 # both parts (tens of minutes on 2 cores)
    python bench/moe.py --part replay   # only the engines' replay figures
    python bench/moe.py --write         # and update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    bench_model,
    init_gloo,
    publish,
    run_ranks,
    section,
    status_kib,
)
from e2e_throughput import task_prompts, write_task
from scale import (
    NEW_TOKENS,
    PROMPTS,
    SAMPLES,
    STAGES,
    hybridflow,
    measure_floor,
    median,
    overrides,
    peak_rss,
)

TITLE = "## Mixture of experts: routing replay and the GRPO step (`bench/moe.py`)"
SHAPE = "qwen3-30b-a3b-scaled"
DTYPE = "bfloat16"
STEPS, WARMUP = 3, 1


# ----------------------------------------------------------------------------- replay part


class ExpertsRun:
    """The expert ids each MoE layer's experts module was called with (a pre-hook on the
    experts, so it sees what the router hooks, replay included, finally handed them)."""

    def __init__(self, model: Any) -> None:
        self.modules = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
        self.ids: list[Any] = [None] * len(self.modules)
        self.handles: list[Any] = []

    def __enter__(self) -> ExpertsRun:
        for layer, module in enumerate(self.modules):
            self.handles.append(module.register_forward_pre_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, layer: int) -> Any:
        def keep(_module: Any, args: tuple[Any, ...]) -> None:
            self.ids[layer] = args[1].detach().cpu()

        return keep

    def layout(self, rows: int, cols: int) -> Any:
        """``[rows, columns, layers, k]`` as the batch's ``routed_experts``."""
        import torch

        return torch.stack([ids.reshape(rows, cols, -1) for ids in self.ids], dim=2)


def replay_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank: sample with routing recorded, recompute with replay off and on, sync."""
    import torch
    import torch.distributed as dist

    init_gloo(rank, world, port)
    from hf_core.engines import SamplingParams
    from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, recorded_mask, same_sets
    from hf_fsdp import heads
    from hf_fsdp.engine import FSDPEngine
    from hf_fsdp.rollout import TransformersRolloutEngine

    rollout = TransformersRolloutEngine({"model_path": args.model, "dtype": DTYPE})
    actor = FSDPEngine({"model_path": args.model, "param_dtype": DTYPE, "trainable": False})
    share = PROMPTS // world
    prompts = task_prompts(args.model, args.data, rank * share, share)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=NEW_TOKENS, n=SAMPLES, seed=rank, routed_experts=True
    )
    began = time.perf_counter()
    samples = rollout.generate(prompts, params)
    generate_s = time.perf_counter() - began
    routed = samples[ROUTED_EXPERTS_KEY]
    mask = samples["response_mask"].bool()
    rollout_lp = samples["rollout_log_probs"]

    def recompute(batch: Any) -> tuple[torch.Tensor, heads.ForwardTokens]:
        tokens = heads.ForwardTokens()
        with torch.no_grad():
            out = heads.forward("lm", actor.model, batch, actor.device, 1.0, tokens=tokens)
        return out["log_probs"].float().cpu(), tokens

    plain = samples.select(*(k for k in samples.keys() if k != ROUTED_EXPERTS_KEY))
    off_lp, _ = recompute(plain)
    # Replay on: the training router's own choice is counted by the replaying hooks (its
    # agreement is what replay off would run); the experts run are read back after them.
    rows, cols = samples["input_ids"].shape
    with ExpertsRun(actor.model) as ran:
        on_lp, tokens = recompute(samples)
    used = ran.layout(rows, cols)
    recorded = recorded_mask(routed).all(-1) & samples["attention_mask"].bool()[..., None]
    on_agree = same_sets(used, routed)[recorded].float().mean()
    own = tokens.routing.metrics()

    def diff(lp: torch.Tensor) -> torch.Tensor:
        return (lp - rollout_lp.float()).abs()[mask]

    # The weight sync as the loop runs it (t_g = 1: each rank receives the whole model).
    dist.barrier()
    began = time.perf_counter()
    sent = 0
    for bucket in actor.export_weights(256 * 2**20):
        rollout.load_weights(bucket)
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
    rollout.finish_weight_sync()
    dist.barrier()
    sync_s = time.perf_counter() - began
    model_bytes = sum(t.numel() * t.element_size() for t in rollout.model.state_dict().values())
    return {
        "tokens": int(mask.sum()),
        "generate_s": generate_s,
        "off_abs_diff_mean": float(diff(off_lp).mean()),
        "off_abs_diff_max": float(diff(off_lp).max()),
        "on_abs_diff_mean": float(diff(on_lp).mean()),
        "on_abs_diff_max": float(diff(on_lp).max()),
        "off_router_agreement": own.get("moe/router_agreement"),
        "on_router_agreement": float(on_agree),
        "routing_bytes": int(routed.numel() * routed.element_size()),
        "routing_bytes_per_token": int(routed[0, 0].numel() * routed.element_size()),
        "routing_dtype": str(routed.dtype).removeprefix("torch."),
        "sync_s": sync_s,
        "sync_bytes": sent,
        "model_bytes": model_bytes,
        "peak_rss_gib": status_kib("VmHWM") / 2**20,
    }


def replay_part(model: Path, data: Path) -> dict[str, Any]:
    ranks = run_ranks(replay_rank, 2, argparse.Namespace(model=str(model), data=str(data)))
    by_rank = [ranks[r] for r in sorted(ranks)]
    tokens = [r["tokens"] for r in by_rank]

    def weighted(key: str) -> float:
        return sum(r[key] * n for r, n in zip(by_rank, tokens, strict=True)) / sum(tokens)

    return {
        "tokens": sum(tokens),
        **{k: weighted(k) for k in ("off_abs_diff_mean", "on_abs_diff_mean")},
        **{k: max(r[k] for r in by_rank) for k in ("off_abs_diff_max", "on_abs_diff_max")},
        "off_router_agreement": statistics.mean(r["off_router_agreement"] for r in by_rank),
        "on_router_agreement": min(r["on_router_agreement"] for r in by_rank),
        "routing_bytes_step": sum(r["routing_bytes"] for r in by_rank),
        "routing_bytes_per_token": by_rank[0]["routing_bytes_per_token"],
        "routing_dtype": by_rank[0]["routing_dtype"],
        "sync_s": max(r["sync_s"] for r in by_rank),
        "sync_bytes_per_rank": [r["sync_bytes"] for r in by_rank],
        "plan_bytes_per_rank": by_rank[0]["model_bytes"],
        "peak_rss_gib": [round(r["peak_rss_gib"], 2) for r in by_rank],
    }


# ------------------------------------------------------------------------------ steps part


def step_row(model: Path, data: Path, work: Path, replay: str) -> dict[str, Any]:
    out = work / f"steps-{replay}"
    args = [  # bench/scale.py's GRPO row (2 processes x 1 thread), its step count and replay
        *overrides(model, data, out, "fsdp-transformers", DTYPE, SHAPE),
        f"run.total_steps={STEPS}",
        f"algorithm.router_replay={replay}",
    ]
    rows, _ = hybridflow(args, out)
    measured = rows[WARMUP:]
    step = median(measured, "perf/step_s") or float("nan")
    floor = measure_floor(args, data)
    return {
        "step_s": step,
        "floor_s": floor,
        "floor_ratio": step / floor,
        "stages": {s: median(measured, f"timing/{s}") for s in STAGES},
        "routing_bytes": median(measured, "moe/routing_bytes"),
        "agreement": median(measured, "actor/moe/router_agreement"),
        "mismatch": median(measured, "rollout/logprob_abs_diff_mean"),
        "peak_rss_gib": peak_rss(rows),
    }


# ----------------------------------------------------------------------------------- report


def _cell(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def replay_table(r: dict[str, Any]) -> str:
    lines = [
        "| routing replay | mean abs logp diff | max abs logp diff | router agreement |",
        "|---|---:|---:|---:|",
        f"| off | {r['off_abs_diff_mean']:.2e} | {r['off_abs_diff_max']:.2e} "
        f"| {100 * r['off_router_agreement']:.2f}% |",
        f"| on | {r['on_abs_diff_mean']:.2e} | {r['on_abs_diff_max']:.2e} "
        f"| {100 * r['on_router_agreement']:.2f}% |",
        "",
        f"{r['tokens']} sampled tokens.  Routing data: {r['routing_bytes_per_token']} bytes per "
        f"token ({r['routing_dtype']}), {r['routing_bytes_step'] / 2**10:.1f} KiB for the "
        f"step's batch.  Weight sync (t_g = 1): {r['sync_s']:.2f} s, bytes per rank "
        f"{r['sync_bytes_per_rank']} against the plan's {r['plan_bytes_per_rank']}.  Peak RSS "
        f"per process: {r['peak_rss_gib']} GiB.",
    ]
    return "\n".join(lines) + "\n"


def steps_table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        "| router_replay | step s | floor x | generate s | update s | sync s "
        "| routing KiB | agreement | abs logp diff | peak RSS GiB |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for replay, r in rows.items():
        st = r["stages"]
        kib = None if r["routing_bytes"] is None else r["routing_bytes"] / 2**10
        lines.append(
            f"| {replay} | {_cell(r['step_s'], '.2f')} | {_cell(r['floor_ratio'], '.2f')} "
            f"| {_cell(st['generate'], '.2f')} | {_cell(st['update_actor'], '.2f')} "
            f"| {_cell(st['weight_sync'])} | {_cell(kib, '.1f')} | {_cell(r['agreement'])} "
            f"| {_cell(r['mismatch'], '.2e')} | {_cell(r['peak_rss_gib'], '.2f')} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["replay", "steps", "both"], default="both")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    model = bench_model(SHAPE, DTYPE)
    body = ""
    with tempfile.TemporaryDirectory(prefix="hf-moe-") as tmp:
        work = Path(tmp)
        data = write_task(work / "task.jsonl", rows=64)
        if args.part in ("replay", "both"):
            replay = replay_part(model, data)
            print(json.dumps(replay), flush=True)
            body += "### Routing replay on the bare engines\n\n" + replay_table(replay) + "\n"
        if args.part in ("steps", "both"):
            rows = {}
            for setting in ("off", "rollout"):
                rows[setting] = step_row(model, data, work, setting)
                print(setting, json.dumps(rows[setting]), flush=True)
            body += "### GRPO steps (FSDP -> transformers)\n\n" + steps_table(rows)
    description = (
        f"`{SHAPE}` in {DTYPE} (random weights), {PROMPTS} prompts x {SAMPLES} samples, "
        f"{NEW_TOKENS} new tokens, temperature 1, 2 processes x 1 thread (FSDP2 shards).  "
        "|logp diff|: the training engine's recomputed log-prob of each sampled token against "
        "the rollout engine's.  Router agreement: (token, MoE layer) top-k sets of the training "
        "forward equal to the rollout's.  Steps: median of "
        f"{STEPS - WARMUP} after a warm-up; 'floor x' as in `bench/scale.py`."
    )
    publish(TITLE, section(TITLE, description, body), args.write)


if __name__ == "__main__":
    main()
