"""Distillation demo: an untrained student learns the digit task from a teacher alone.

    python recipes/distill_demo.py [--teacher PATH] [--loss LOSS] [key=value ...]
    python recipes/distill_demo.py --compare [--teacher PATH] [--seeds 0,1,2] [key=value ...]

1. Teacher: the README demo (a supervised warm start, then GRPO), exported as a HF folder.
   ``--teacher PATH`` uses a folder trained before instead.
2. Student: the same untrained model, no warm start and no task reward in its training signal
   (``reward.weight=0``: the reward is logged and validated only).  The teacher is the whole
   signal (``algorithm.distill``): ``--loss reverse_kl`` (the default) scores the student's
   sampled tokens with the teacher's log-probs; ``--loss forward_kl_topk`` or ``jsd`` matches
   the teacher's top-k distribution at every response token (:data:`TOP_K_SETTINGS`).

The student passes when its final validation reward reaches ``REQUIRED_SHARE`` of the
teacher's (both greedy, on the same validation prompts).

``--compare`` trains a student with each of :data:`COMPARED` losses for every seed, validating
every :data:`COMPARE_VAL_EVERY` steps, and reports for each the first step whose validation
reward reaches ``TARGET_SHARE`` of the teacher's.  It passes when the top-k loss reaches it
in every seed and in fewer steps than reverse KL on average (a run that never reaches it
counts as its total steps).  The figures go to ``runs/distill_demo/compare.json``.
``key=value`` overrides apply to the students' runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from demo import RECIPE, build_assets

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer

OUTPUT = Path("runs/distill_demo")
REQUIRED_SHARE = 0.8
TARGET_SHARE = 0.9
STUDENT = [
    "sft.steps=0",
    "reward.weight=0",
    "teacher.backend=fsdp",
    "actor.engine.lr=2.0e-3",  # from scratch, no warm start: twice the demo's rate
]
"""What turns the demo recipe into pure distillation (the teacher's path is added)."""
TOP_K_SETTINGS = ["algorithm.distill.top_k=16", "algorithm.distill.tail=bucket"]
"""The top-k losses' settings here: the teacher's 16 likeliest of the tiny model's 128
tokens per position, the rest of its mass as one more category."""
LOSSES = ("reverse_kl", "forward_kl_topk", "jsd")
COMPARED = ("reverse_kl", "forward_kl_topk")
COMPARE_VAL_EVERY = 10


def validation_curve(output_dir: Path) -> list[tuple[int, float]]:
    """``(step, val/reward_mean)`` of every validation a run logged."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").open()]
    return [(int(r["step"]), float(r["val/reward_mean"])) for r in rows if "val/reward_mean" in r]


def final_validation(output_dir: Path) -> float:
    """The last ``val/reward_mean`` a run logged."""
    curve = validation_curve(output_dir)
    if not curve:
        raise RuntimeError(f"{output_dir}: no validation reward was logged")
    return curve[-1][1]


def first_step_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first validated step whose reward is at least ``target`` (None: never)."""
    return next((step for step, value in curve if value >= target), None)


def train(overrides: list[str]) -> Path:
    """Run the demo recipe with ``overrides``; its output folder."""
    config = load_config(TrainerConfig, RECIPE, overrides)
    RLTrainer(config).fit()
    return Path(config.run.output_dir)


def loss_overrides(loss: str) -> list[str]:
    """The student's ``algorithm.distill`` settings for ``loss``."""
    if loss not in LOSSES:
        raise SystemExit(f"--loss {loss}: expected one of {', '.join(LOSSES)}")
    return [f"algorithm.distill.loss={loss}", *(TOP_K_SETTINGS if loss != "reverse_kl" else [])]


def student(assets: list[str], teacher: Path, folder: Path, extra: list[str]) -> Path:
    """Train one student from the untrained model; its output folder."""
    return train(
        [*assets, f"run.output_dir={folder}", *STUDENT, f"teacher.model_path={teacher}", *extra]
    )


def compare(assets: list[str], teacher: Path, teacher_reward: float, argv: list[str]) -> int:
    """``--compare``: steps to ``TARGET_SHARE`` of the teacher, per loss and seed."""
    seeds = [0, 1, 2]
    if argv[:1] == ["--seeds"]:
        seeds, argv = [int(s) for s in argv[1].split(",")], argv[2:]
    runs: dict[str, list[Path]] = {}
    for loss in COMPARED:
        for seed in seeds:
            folder = OUTPUT / f"student_{loss}_seed{seed}"
            extra = [
                *loss_overrides(loss),
                f"run.seed={seed}",
                f"run.val_every={COMPARE_VAL_EVERY}",
            ]
            runs.setdefault(loss, []).append(student(assets, teacher, folder, [*extra, *argv]))
    total = load_config(TrainerConfig, RECIPE, [*assets, *argv]).run.total_steps
    return report(runs, seeds, teacher_reward, total)


def report(runs: dict[str, list[Path]], seeds: list[int], teacher_reward: float, total: int) -> int:
    """Steps to the target per loss and seed from the students' metrics, printed and written
    to ``compare.json``; 0 when the top-k loss reaches it in every seed and faster on average
    (a run that never reaches it counts as ``total`` steps)."""
    target = TARGET_SHARE * teacher_reward
    results = {
        loss: [
            {
                "seed": seed,
                "steps_to_target": first_step_reaching(validation_curve(run), target),
                "final": validation_curve(run)[-1][1],
                "curve": validation_curve(run),
            }
            for seed, run in zip(seeds, folders, strict=True)
        ]
        for loss, folders in runs.items()
    }

    def mean_steps(loss: str) -> float:
        reached = [r["steps_to_target"] for r in results[loss]]
        return sum(total if step is None else int(step) for step in reached) / len(reached)  # type: ignore[call-overload]

    summary = {
        "teacher_reward": teacher_reward,
        "target": target,
        "seeds": seeds,
        "mean_steps_to_target": {loss: mean_steps(loss) for loss in results},
        "runs": results,
    }
    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "compare.json").write_text(json.dumps(summary, indent=2))
    print(f"distill demo --compare: teacher {teacher_reward:.4f}, target {target:.4f}")
    for loss in results:
        steps = ", ".join(str(r["steps_to_target"] or "never") for r in results[loss])
        finals = ", ".join(f"{r['final']:.3f}" for r in results[loss])
        print(
            f"  {loss}: steps to target per seed {steps} (mean {mean_steps(loss):.0f}); "
            f"final {finals}"
        )
    top_k, reverse = COMPARED[1], COMPARED[0]
    every_seed = all(r["steps_to_target"] is not None for r in results[top_k])
    faster = mean_steps(top_k) < mean_steps(reverse)
    verdict = "top-k is faster" if every_seed and faster else "top-k is NOT faster"
    print(f"  -> {verdict} (figures in {OUTPUT / 'compare.json'})")
    return 0 if every_seed and faster else 1


def main(argv: list[str]) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a single-machine demo
    teacher_path = None
    if argv[:1] == ["--teacher"]:
        teacher_path, argv = Path(argv[1]).resolve(), argv[2:]
    comparing = argv[:1] == ["--compare"]
    argv = argv[1:] if comparing else argv
    loss = "reverse_kl"
    if argv[:1] == ["--loss"]:
        loss, argv = argv[1], argv[2:]
    assets = [f"{k}={v}" for k, v in build_assets(OUTPUT / "assets").items()]
    teacher_run = OUTPUT / "teacher"
    trained_here = teacher_path is None
    if teacher_path is None:
        train([*assets, f"run.output_dir={teacher_run}", "run.export_final=true"])
        teacher_path = teacher_run / "actor_hf"
    if comparing:
        if not trained_here:
            raise SystemExit("--compare measures against the teacher's reward: train it here")
        return compare(assets, teacher_path, final_validation(teacher_run), argv)
    run = student(assets, teacher_path, OUTPUT / "student", [*loss_overrides(loss), *argv])
    reward = final_validation(run)
    teacher = final_validation(teacher_run) if trained_here else None
    if teacher is None:
        print(f"distill demo: student validation reward {reward:.4f} (teacher not measured)")
        return 0
    share = reward / teacher if teacher > 0 else 0.0
    verdict = "learned" if share >= REQUIRED_SHARE else "did not learn enough"
    print(
        f"distill demo ({loss}): validation reward teacher {teacher:.4f}, student {reward:.4f} "
        f"({share:.0%} of the teacher; needs {REQUIRED_SHARE:.0%}) -> {verdict}"
    )
    return 0 if share >= REQUIRED_SHARE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
