"""On-policy distillation demo: an untrained student learns the digit task from a teacher alone.

    python recipes/distill_demo.py [--teacher PATH] [key=value ...]

1. Teacher: the README demo (a supervised warm start, then GRPO), exported as a HF folder.
   ``--teacher PATH`` uses a folder trained before instead.
2. Student: the same untrained model, no warm start and no task reward in its training signal
   (``reward.weight=0``: the reward is logged and validated only).  The teacher's per-token
   log-probs of the student's own samples are the whole signal (``algorithm.distill``).

The student passes when its final validation reward reaches ``REQUIRED_SHARE`` of the
teacher's (both greedy, on the same validation prompts).  ``key=value`` overrides apply to
the student's run.
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
STUDENT = [
    "sft.steps=0",
    "reward.weight=0",
    "teacher.backend=fsdp",
    "actor.engine.lr=2.0e-3",  # from scratch, no warm start: twice the demo's rate
]
"""What turns the demo recipe into pure distillation (the teacher's path is added)."""


def final_validation(output_dir: Path) -> float:
    """The last ``val/reward_mean`` a run logged."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").open()]
    values = [row["val/reward_mean"] for row in rows if "val/reward_mean" in row]
    if not values:
        raise RuntimeError(f"{output_dir}: no validation reward was logged")
    return float(values[-1])


def train(overrides: list[str]) -> Path:
    """Run the demo recipe with ``overrides``; its output folder."""
    config = load_config(TrainerConfig, RECIPE, overrides)
    RLTrainer(config).fit()
    return Path(config.run.output_dir)


def main(argv: list[str]) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a single-machine demo
    teacher_path = None
    if argv[:1] == ["--teacher"]:
        teacher_path, argv = Path(argv[1]).resolve(), argv[2:]
    assets = [f"{k}={v}" for k, v in build_assets(OUTPUT / "assets").items()]
    teacher_run = OUTPUT / "teacher"
    trained_here = teacher_path is None
    if teacher_path is None:
        train([*assets, f"run.output_dir={teacher_run}", "run.export_final=true"])
        teacher_path = teacher_run / "actor_hf"
    student_run = train(
        [
            *assets,
            f"run.output_dir={OUTPUT / 'student'}",
            *STUDENT,
            f"teacher.model_path={teacher_path}",
            *argv,
        ]
    )
    student = final_validation(student_run)
    teacher = final_validation(teacher_run) if trained_here else None
    if teacher is None:
        print(f"distill demo: student validation reward {student:.4f} (teacher not measured)")
        return 0
    share = student / teacher if teacher > 0 else 0.0
    verdict = "learned" if share >= REQUIRED_SHARE else "did not learn enough"
    print(
        f"distill demo: validation reward teacher {teacher:.4f}, student {student:.4f} "
        f"({share:.0%} of the teacher; needs {REQUIRED_SHARE:.0%}) -> {verdict}"
    )
    return 0 if share >= REQUIRED_SHARE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
