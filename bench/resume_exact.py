"""Resume at the Qwen2.5-0.5B shape is exact: 3 steps straight == 2 steps, stop, resume, 1 more.

The scale bench's 0.5B layout (FSDP -> HF, 2 processes, float32, 4 prompts x 4 samples, 32
new tokens), with a reward that varies within every group (``hf_testing.signal_rewards``) so
that every update moves the weights.  Compared: every metric that is not a time or a memory
reading, and every tensor of the final HF export, bit for bit.  Also reported: the seconds
and bytes of each checkpoint save and of the restore.

    python bench/resume_exact.py            # prints the result
    python bench/resume_exact.py --write    # and updates bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from _common import publish, section
from e2e_throughput import write_task
from scale import RESTORED, SAVED, hybridflow, overrides

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench-models"
TITLE = "## Exact resume at the Qwen2.5-0.5B shape (`bench/resume_exact.py`)"
VOLATILE = ("timing/", "perf/step_s", "perf/throughput", "perf/weight_sync_s", "memory/",
            "timestamp", "handover/")  # fmt: skip
"""Keys that legitimately differ between equal runs (tests/e2e/test_resume.py's list)."""
STEPS, STOP = 3, 2


def stable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def exported_folder(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def exported(out: Path) -> dict[str, Any]:
    """The run's final HF export (``run.export_final``)."""
    return exported_folder(out / "actor_hf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    from hf_testing.real_shapes import cached_shape_model

    model = cached_shape_model("qwen2.5-0.5b", CACHE)
    with tempfile.TemporaryDirectory(prefix="hf-resume-") as tmp:
        work = Path(tmp)
        data = write_task(work / "task.jsonl", rows=256)

        def run(name: str, steps: int, resume: bool = False) -> tuple[list[dict], str]:
            out = work / name
            extra = [
                f"run.total_steps={steps}",
                f"run.save_every={STOP}",
                "run.export_final=true",
                "reward.function=hf_testing.signal_rewards:digit_share",
                "actor.engine.lr=1e-5",
            ]
            return hybridflow([*overrides(model, data, out, "fsdp-transformers", "float32", "0.5B"),
                               *extra], out, resume=resume)  # fmt: skip

        straight, straight_log = run("straight", STEPS)
        _, stopped_log = run("stopped", STOP)
        resumed, resumed_log = run("stopped", STEPS, resume=True)
        a, b = exported(work / "straight"), exported(work / "stopped")
        metrics_equal = [stable(r) for r in straight] == [stable(r) for r in resumed]
        differing = sorted(n for n in a if n not in b or not a[n].equal(b[n]))
        initial = exported_folder(model)
        moved = sum(not a[n].equal(initial[n]) for n in a if n in initial)
        saves = SAVED.findall(straight_log + stopped_log)
        restore = RESTORED.findall(resumed_log)
    result = {
        "metrics_equal": metrics_equal,
        "tensors": len(a),
        "tensors_differing": differing,
        "tensors_moved": moved,
        "reward_mean": [r.get("reward/mean") for r in straight],
        "save_s": [float(s) for s, _ in saves],
        "checkpoint_bytes": int(saves[-1][1]) if saves else None,
        "restore_s": float(restore[-1]) if restore else None,
    }
    print(json.dumps(result, indent=1))
    exact = metrics_equal and not differing and bool(a) and moved > 0
    verdict = "exact" if exact else "NOT exact"
    body = (
        f"| steps | compared | result | save s | restore s | checkpoint GiB |\n"
        f"|---|---|---|---:|---:|---:|\n"
        f"| {STEPS} straight vs {STOP} + resume + {STEPS - STOP} | every stable metric of "
        f"{len(straight)} steps, {len(a)} exported tensors ({moved} moved from the "
        f"initial weights) | {verdict} ({len(differing)} tensors differ) | "
        f"{', '.join(f'{s:.1f}' for s in result['save_s'])} | "
        f"{result['restore_s'] or float('nan'):.1f} | "
        f"{(result['checkpoint_bytes'] or 0) / 2**30:.2f} |\n"
    )
    description = (
        "Qwen2.5-0.5B shape (random weights, float32), FSDP -> HF, "
        "2 processes, 4 prompts x 4 samples, 32 new tokens, reward `digit_share` (varies in "
        f"every group, so the weights move: reward means {result['reward_mean']}), "
        f"checkpoint every {STOP} steps."
    )
    print(body)
    publish(TITLE, section(TITLE, description, body), args.write)
    if verdict != "exact":
        raise SystemExit(f"resume is not exact: {result}")


if __name__ == "__main__":
    main()
