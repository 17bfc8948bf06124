"""The 3D-HybridEngine transition of the megatron engine: the paper's plan vs the naive one.

Four ranks (torch.multiprocessing, gloo on CPU, no Ray: only the transition is measured)
hold a megatron model in the training layout p=2, t=2, d=1.  One transition =
``engine.export_slices(bucket_bytes, plan)`` consumed to the end (each yielded bucket is
dropped at once, so what is measured is the reshard itself, not a rollout engine's copy).
Generation layouts (p_g, t_g): (1, 1), (1, 2) and (2, 1), each with core's hybrid plan
(micro-DP all-gathers, HybridFlow) and naive plan (all-gather the DP replica, HybridFlow-V).

Per rank and transition:

* received = bytes of other ranks' units that landed in this rank's buffers (the engine's
  count), next to Table 2's formula x M, where M is the model as the all-gathers move it
  (p*t units, each padded to the largest);
* wire = the OS's count of bytes this process wrote (``/proc/self/io`` wchar delta): gloo's
  sends, an independent check of the volume;
* peak extra = peak RSS during the transition minus RSS before it (VmHWM reset through
  ``/proc/self/clear_refs``; glibc mmap threshold pinned to 64 KiB so freed buffers leave RSS
  at once); buffers = the engine's own count of its live transition buffers at their peak;
* seconds = wall time of the transition (median of the repeats, slowest rank).

The "whole unit" bucket gathers each rank's full unit in one collective: no streaming, so
peak memory shows Table 2's "Peak Mem." column (M / (t_g p_g) vs M).

Usage: python bench/megatron_reshard.py [--hidden 512 --layers 8] [--write]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from fractions import Fraction
from pathlib import Path

from _common import (
    MIB,
    init_gloo,
    machine_line,
    peak_extra,
    pin_mmap_threshold,
    publish,
    run_ranks,
    training_bench_model,
)

SECTION = "## megatron 3D-HybridEngine reshard: paper's plan vs naive (`bench/megatron_reshard.py`)"
GEN_LAYOUTS = [(1, 1), (1, 2), (2, 1)]  # (p_g, t_g)
WORLD, TP, PP = 4, 2, 2


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    init_gloo(rank, world, port)
    from hf_megatron.engine import MegatronEngine

    engine = MegatronEngine(
        {
            "model_path": args.model,
            "tensor_parallel_size": TP,
            "pipeline_parallel_size": PP,
            "trainable": False,
        }
    )
    rows = []
    for p_g, t_g in GEN_LAYOUTS:
        for kind in ("hybrid", "naive"):
            plan = engine.reshard_plan(gen_tp=t_g, gen_pp=p_g, kind=kind)
            for bucket in (*[int(b * MIB) for b in args.buckets], None):
                # warm-up (first-call allocations of gloo and the groups), not measured
                for _ in engine.export_slices(int(args.buckets[0] * MIB), plan):
                    pass
                unit_bytes = engine.reshard_stats.unit_numel * engine.reshard_stats.element_size
                size = bucket or unit_bytes * len(plan.for_rank(rank).gather_group)
                times, extras, stats = [], [], None
                for _ in range(args.repeats):
                    gc.collect()
                    dist.barrier()
                    with peak_extra() as peak:
                        for out in engine.export_slices(size, plan):
                            del out
                        dist.barrier()
                    stats = engine.reshard_stats
                    times.append(stats.seconds)
                    extras.append(peak["bytes"])
                rows.append(
                    {
                        "gen": (p_g, t_g),
                        "kind": kind,
                        "bucket": bucket,
                        "seconds": statistics.median(times),
                        "extra": max(extras),
                        "buffers": stats.peak_buffer_bytes,
                        "received": stats.received_bytes,
                        "wire": stats.wire_bytes_written,
                        "model_bytes": stats.model_bytes,
                        "real_bytes": stats.real_model_numel * stats.element_size,
                        "zero_redundancy": stats.zero_redundancy,
                        "group": len(stats.gather_group),
                    }
                )
    dist.destroy_process_group()
    return {"rows": rows, "params": engine.num_params}


def _fmt(value: float) -> str:
    return f"{value / MIB:.2f}"


def _formula(kind: str, p_g: int, t_g: int) -> Fraction:
    """Table 2: HybridFlow (tp - t_g p_g)/(t_g p_g tp) M; HybridFlow-V (tp - 1)/tp M."""
    tp, gg = TP * PP, t_g * p_g
    return Fraction(tp - gg, gg * tp) if kind == "hybrid" else Fraction(tp - 1, tp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--buckets", type=float, nargs="+", default=[4.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    pin_mmap_threshold()
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        args.model = training_bench_model(Path(tmp) / "model", args.hidden, args.layers)
        results = run_ranks(_rank_main, WORLD, args)

    first = results[0]["rows"][0]
    lines = [
        SECTION,
        "",
        f"Model: tiny Qwen2, hidden {args.hidden}, {args.layers} layers, "
        f"{results[0]['params'] / 1e6:.1f} M parameters, float32. Training layout p=2, t=2, "
        f"d=1 on 4 ranks (gloo, CPU, 1 thread each, megatron rank order tp-dp-pp). "
        f"M = {_fmt(first['model_bytes'])} MiB: the model as the all-gathers move it (4 units, "
        f"each padded to the largest; the units themselves sum to {_fmt(first['real_bytes'])} "
        "MiB: TP-replicated norms count per rank, vocabulary padded to 256). Median of "
        f"{args.repeats} transitions after an unmeasured warm-up; per-rank columns show the "
        "largest value over the 4 ranks (received bytes were identical on all ranks).",
        "",
        "Received = other ranks' bytes landed in this rank's buffers (engine count); Table 2 = "
        "the paper's formula x M; wire = bytes the OS saw the process write (gloo's sends); "
        "peak extra = peak RSS during the transition minus RSS before (VmHWM reset, glibc "
        "mmap threshold 64 KiB); buffers = the engine's own peak of live transition buffers. "
        "Each yielded bucket is dropped at once (the reshard alone, no rollout copy). "
        "'whole unit' = one collective per transition (no streaming).",
        "",
        machine_line(),
        "",
        "| gen (p_g, t_g) | plan | gather group | bucket | received MiB/rank | Table 2 MiB "
        "| wire MiB | zero redundancy | peak extra MiB | buffers MiB | transition s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ranks = [results[r]["rows"] for r in range(WORLD)]
    for i, row in enumerate(ranks[0]):
        per_rank = [rows[i] for rows in ranks]
        received = {r["received"] for r in per_rank}
        assert len(received) == 1, received
        p_g, t_g = row["gen"]
        formula = _formula(row["kind"], p_g, t_g) * row["model_bytes"]
        assert row["received"] == formula, (row, formula)  # Table 2, exactly
        bucket = "whole unit" if row["bucket"] is None else f"{row['bucket'] / MIB:g} MiB"
        lines.append(
            f"| ({p_g}, {t_g}) | {row['kind']} | {row['group']} | {bucket} "
            f"| {_fmt(row['received'])} | {_fmt(float(formula))} "
            f"| {_fmt(max(r['wire'] for r in per_rank))} "
            f"| {'yes' if all(r['zero_redundancy'] for r in per_rank) else 'no'} "
            f"| {_fmt(max(r['extra'] for r in per_rank))} "
            f"| {_fmt(max(r['buffers'] for r in per_rank))} "
            f"| {max(r['seconds'] for r in per_rank):.3f} |"
        )
    lines += ["", _summary(ranks)]
    publish(SECTION, "\n".join(lines) + "\n", args.write)


def _summary(ranks: list[list[dict]]) -> str:
    def pick(gen: tuple[int, int], kind: str, streamed: bool) -> list[dict]:
        index = next(
            i
            for i, r in enumerate(ranks[0])
            if r["gen"] == gen and r["kind"] == kind and (r["bucket"] is not None) == streamed
        )
        return [rows[index] for rows in ranks]

    hyb, nav = pick((1, 2), "hybrid", False), pick((1, 2), "naive", False)
    hyb_s, nav_s = pick((1, 2), "hybrid", True), pick((1, 2), "naive", True)
    m = ranks[0][0]["model_bytes"]
    return (
        f"Result: every rank received exactly Table 2's volume in every row. For t_g = 2 "
        f"(p_g = 1) the paper's plan gathers within pairs of ranks: "
        f"{_fmt(hyb[0]['received'])} MiB per rank (1/4 M) against {_fmt(nav[0]['received'])} "
        f"MiB (3/4 M) for the naive plan, with zero redundancy; the OS-level write counts "
        f"agree within gloo's framing. Without streaming, the peak extra memory is "
        f"{_fmt(max(r['extra'] for r in hyb))} MiB (hybrid) vs "
        f"{_fmt(max(r['extra'] for r in nav))} MiB (naive) against M = {_fmt(m)} MiB: "
        f"the gathered buffer is M/(t_g p_g) vs M as in Table 2, and the canonical tensors "
        f"assembled from it (TP pieces concatenated, QKV de-interleaved) are copies on top. "
        f"Streamed in "
        f"4 MiB buckets it drops to {_fmt(max(r['extra'] for r in hyb_s))} / "
        f"{_fmt(max(r['extra'] for r in nav_s))} MiB, about a bucket plus the tensors in "
        f"flight. Transition time follows the volume: "
        f"{max(r['seconds'] for r in hyb_s):.3f} s vs {max(r['seconds'] for r in nav_s):.3f} s "
        "(streamed). For (p_g, t_g) = (1, 1) the two plans coincide (d_g = p t: the whole "
        "replica is one micro-DP group). Timings on this shared 2-core machine vary +-30% "
        "run to run."
    )


if __name__ == "__main__":
    main()
