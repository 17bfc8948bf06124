"""The whole post-training pipeline on a digit task, from an untrained model:

    python recipes/pipeline_demo.py [key=value ...]    # settings: recipes/demo_pipeline.yaml

1. builds the tiny untrained model and the task (``pipeline.task``: sort, or reverse) locally
   (the README demo's shapes, deterministic; no model hub);
2. SFT (``trainer: sft``) on prompt/completion demonstrations;
3. samples ``pipeline.samples_per_prompt`` answers (temperature 1) of the SFT model to each
   pair prompt, ranks them with the partial-credit rule reward (``digit_partial_credit``, the
   stand-in for a human labeller) and writes the best as ``chosen`` and the worst as
   ``rejected`` (prompts whose samples all score the same are dropped), a training and a
   held-out split;
4. a reward model (``trainer: reward_model``) on those pairs, its score head on the SFT
   model's backbone: its held-out pair accuracy must reach ``required.reward_model_accuracy``;
5. PPO (``trainer: rl``, GAE with a critic) from the SFT model whose only reward is the
   reward model, in
   ``pipeline.rl_rounds`` rounds (iterated RLHF): after each round the RL policy's own samples
   on fresh prompts are ranked the same way, join the pairs, and the reward model trains on
   from where it was; the KL anchor stays the SFT model;
6. DPO (``trainer: dpo``) from the SFT model, against it, on the SFT model's pairs.

Every policy's figure (untrained, SFT, each RL round, DPO) is the same measurement on
``pipeline.eval_prompts`` held-out prompts (none of them in any training set): the mean rule
reward of its samples (temperature 1, :data:`SAMPLES_PER_EVAL_PROMPT` a prompt: the expected
reward RL and DPO optimise) and of its greedy answers.  RL must beat SFT's sampled figure by
``required.rl_gain`` and DPO must beat it; the script prints a table of the stages and exits 1
when a figure is missed.

Overrides: ``<stage>.<key>=value`` for a stage (``sft``, ``reward_model``, ``rl``, ``dpo``),
e.g. ``rl.run.total_steps=300``; ``pipeline.<key>=value`` for the demo's own settings; a key
with no stage name goes to every stage (``placement.processes=1``).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hf_core.config import TrainerConfig, validate
from hf_core.data.io import write_jsonl
from hf_core.rewards.builtin import digit_partial_credit
from hf_core.trainer import trainer_class
from hf_testing.tasks import make_digit_demonstrations, make_digit_task
from hf_testing.tiny import build_tiny_model

SETTINGS = Path(__file__).with_name("demo_pipeline.yaml")
STAGES = ("sft", "reward_model", "rl", "dpo")


# ------------------------------------------------------------------ settings
def load_settings(argv: list[str]) -> dict[str, Any]:
    """demo_pipeline.yaml with the command line's ``key=value`` overrides applied."""
    bad = [a for a in argv if "=" not in a or a.startswith("=")]
    if bad:
        raise SystemExit(f"arguments must look like key=value, got {bad}; see {SETTINGS.name}")
    base = OmegaConf.load(SETTINGS)
    staged = [a for a in argv if a.split(".")[0] in (*STAGES, "pipeline", "common")]
    shared = [f"common.{a}" for a in argv if a not in staged]
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist([*staged, *shared]))
    settings = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(settings, dict)
    return settings


def stage_config(settings: dict[str, Any], stage: str, **paths: Any) -> TrainerConfig:
    """The stage's recipe: ``common``, then the stage's section, then ``paths`` (dotted keys,
    the files this script made), validated as a recipe."""
    out = Path(settings["pipeline"]["output_dir"])
    recipe = OmegaConf.merge(
        OmegaConf.create(settings.get("common") or {}),
        OmegaConf.create({"run": {"output_dir": str(out / stage)}}),
        OmegaConf.create(settings[stage]),
        OmegaConf.from_dotlist([f"{k}={v}" for k, v in paths.items()]),
    )
    data = OmegaConf.to_container(recipe, resolve=True)
    assert isinstance(data, dict)
    return validate(TrainerConfig, data, f"{SETTINGS.name}: {stage}")


# -------------------------------------------------------------------- assets
def held_out_split(settings: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """The prompts of every stage (deterministic): the held-out evaluation prompts, and the
    training sets with those prompts removed."""
    p = settings["pipeline"]
    seed, lengths = int(p["seed"]), {"min_len": int(p["min_len"]), "max_len": int(p["max_len"])}
    task = p["task"]
    evaluation = make_digit_task(task, n=int(p["eval_prompts"]), seed=seed + 1, **lengths)
    pair_val = make_digit_task(task, n=int(p["pair_val_prompts"]), seed=seed + 3, **lengths)
    held_out = {r["prompt"] for r in evaluation}

    def fresh(records: list[dict[str, str]]) -> list[dict[str, str]]:
        return [r for r in records if r["prompt"] not in held_out]

    demos = make_digit_demonstrations(task, n=int(p["demonstrations"]), seed=seed, **lengths)
    sft_val = make_digit_demonstrations(task, n=64, seed=seed + 5, **lengths)
    pairs = make_digit_task(task, n=int(p["pair_prompts"]), seed=seed + 2, **lengths)
    rl = make_digit_task(task, n=int(p["rl_prompts"]), seed=seed + 4, **lengths)
    return {
        "eval": evaluation,
        "sft_train": fresh(demos),
        "sft_val": fresh(sft_val),
        "pair_train": fresh(pairs),
        "pair_val": fresh(pair_val),
        # the RL run never sees the answers: its reward is the reward model's score
        "rl_train": [{"prompt": r["prompt"]} for r in fresh(rl)],
        "rl_val": [{"prompt": r["prompt"]} for r in evaluation],
    }


def build_assets(folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The untrained model and the task files (rebuilt identically every time)."""
    p = settings["pipeline"]
    model = build_tiny_model(folder / "model", seed=int(p["seed"]), **p["model"])
    split = held_out_split(settings)
    files = {
        name: write_jsonl(records, folder / f"{name}.jsonl")
        for name, records in split.items()
        if name not in ("pair_train", "pair_val", "eval")
    }
    return {"model": model, "files": files, "split": split}


# ------------------------------------------------------------- measurements
def _generate(
    model_dir: Path,
    prompts: list[str],
    *,
    max_new_tokens: int,
    samples: int = 1,
    seed: int = 0,
    batch_prompts: int = 64,
) -> list[list[str]]:
    """Each prompt's ``samples`` answers (greedy for ``samples=1``, else temperature-1
    samples), decoded up to the first EOS: the transformers model in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sampling = (
        {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        if samples > 1
        else {"do_sample": False}
    )
    out: list[list[str]] = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_prompts):
            chunk = prompts[start : start + batch_prompts]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            ids = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                num_return_sequences=samples,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )[:, enc["input_ids"].shape[1] :]
            texts = []
            for row in ids.tolist():
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                texts.append(tokenizer.decode(row, skip_special_tokens=True))
            out += [texts[i * samples : (i + 1) * samples] for i in range(len(chunk))]
    return out


def rule_reward(
    model_dir: Path,
    records: list[dict[str, str]],
    max_new_tokens: int,
    *,
    samples: int = 1,
    seed: int = 0,
) -> float:
    """Mean rule reward of the model's answers to ``records``: its greedy answer
    (``samples=1``), or ``samples`` temperature-1 samples a prompt (the policy RL optimises)."""
    answers = _generate(
        model_dir,
        [r["prompt"] for r in records],
        max_new_tokens=max_new_tokens,
        samples=samples,
        seed=seed,
    )
    scores = [
        digit_partial_credit(answer, r["ground_truth"])
        for group, r in zip(answers, records, strict=True)
        for answer in group
    ]
    return sum(scores) / len(scores)


@dataclass
class PairStats:
    kept: int = 0
    chosen_reward: float = 0.0
    rejected_reward: float = 0.0


def sample_pairs(
    model_dir: Path,
    records: list[dict[str, str]],
    *,
    k: int,
    pairs_per_prompt: int,
    max_new_tokens: int,
    seed: int,
) -> tuple[list[dict[str, str]], PairStats]:
    """``k`` samples per prompt ranked by the rule reward: the best as ``chosen`` against the
    worst, then against the next-worst and so on, up to ``pairs_per_prompt`` pairs a prompt
    whose rewards differ (finer distinctions than best-versus-worst, which the policy's own
    samples need ranked once RL uses the model); prompts whose samples all score the same
    are dropped, as are blank answers (a pair needs two replies)."""
    answers = _generate(
        model_dir,
        [r["prompt"] for r in records],
        max_new_tokens=max_new_tokens,
        samples=k,
        seed=seed,
    )
    pairs, stats = [], PairStats()
    for record, samples in zip(records, answers, strict=True):
        scored = [(digit_partial_credit(s, record["ground_truth"]), s) for s in samples]
        distinct = sorted({(score, s) for score, s in scored if s.strip()}, reverse=True)
        if len(distinct) < 2 or distinct[0][0] == distinct[-1][0]:
            continue
        ranked = (  # the best against the worst first, then the next-worst, ...
            (better, worse)
            for i, better in enumerate(distinct)
            for worse in reversed(distinct[i + 1 :])
            if better[0] != worse[0]
        )
        for (chosen_score, chosen), (rejected_score, rejected) in itertools.islice(
            ranked, pairs_per_prompt
        ):
            pairs.append({"prompt": record["prompt"], "chosen": chosen, "rejected": rejected})
            stats.chosen_reward += chosen_score
            stats.rejected_reward += rejected_score
    stats.kept = len(pairs)
    if pairs:
        stats.chosen_reward /= len(pairs)
        stats.rejected_reward /= len(pairs)
    return pairs, stats


# -------------------------------------------------------------------- stages
@dataclass
class Report:
    rows: list[tuple[str, str, str, float]] = field(default_factory=list)
    """(stage, figure, value, seconds)"""
    failures: list[str] = field(default_factory=list)

    def add(self, stage: str, figure: str, value: str, seconds: float) -> None:
        self.rows.append((stage, figure, value, seconds))
        print(f"pipeline: {stage}: {figure} = {value} ({seconds:.0f} s)", flush=True)

    def table(self, total: float) -> str:
        width = max(len(f"{s}: {f}") for s, f, _, _ in self.rows)
        values = max(len(v) for _, _, v, _ in self.rows)
        lines = [f"{'stage: figure':<{width}}  {'value':>{values}}  {'wall':>6}"]
        for stage, figure, value, seconds in self.rows:
            lines.append(f"{f'{stage}: {figure}':<{width}}  {value:>{values}}  {seconds:>5.0f}s")
        lines.append(f"{'total':<{width}}  {'':>{values}}  {total:>5.0f}s")
        return "\n".join(lines)


def last_value(run_dir: Path, key: str) -> float | None:
    """The last logged value of ``key`` in a run's metrics.jsonl."""
    value = None
    with (run_dir / "metrics.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            if key in row:
                value = float(row[key])
    return value


def train(config: TrainerConfig) -> Path:
    """Run a recipe; its output folder."""
    trainer_class(config)(config).fit()
    return Path(config.run.output_dir)


@dataclass(frozen=True)
class Figure:
    """A policy's held-out rule reward: its greedy answers, and its samples (temperature 1,
    ``SAMPLES_PER_EVAL_PROMPT`` a prompt: the expected reward RL and DPO optimise)."""

    greedy: float
    sampled: float

    def __str__(self) -> str:
        return f"{self.sampled:.3f} / {self.greedy:.3f}"

    def gain(self, base: Figure) -> str:
        return f"{self.sampled - base.sampled:+.3f} / {self.greedy - base.greedy:+.3f}"


SAMPLES_PER_EVAL_PROMPT = 4
FIGURE = "held-out rule reward sampled / greedy"


def measure(model_dir: Path, records: list[dict[str, str]], tokens: int, seed: int) -> Figure:
    """:class:`Figure` of a policy on ``records`` (the same samples' seed for every stage)."""
    return Figure(
        greedy=rule_reward(model_dir, records, tokens),
        sampled=rule_reward(
            model_dir, records, tokens, samples=SAMPLES_PER_EVAL_PROMPT, seed=seed + 99
        ),
    )


def round_prompts(
    settings: dict[str, Any], round_index: int, held_out: set[str]
) -> list[dict[str, str]]:
    """Fresh prompts for the pairs sampled from the policy after RL round ``round_index``,
    none of them ``held_out``."""
    p = settings["pipeline"]
    records = make_digit_task(
        p["task"],
        n=int(p["round_pair_prompts"]),
        seed=int(p["seed"]) + 100 + round_index,
        min_len=int(p["min_len"]),
        max_len=int(p["max_len"]),
    )
    return [r for r in records if r["prompt"] not in held_out]


def main(argv: list[str]) -> int:
    # A single-machine demo: no need for Ray's cluster token in the home folder.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    began = time.perf_counter()
    settings = load_settings(argv)
    p = settings["pipeline"]
    required = p["required"]
    out = Path(p["output_dir"])
    tokens, seed = int(p["max_new_tokens"]), int(p["seed"])
    report = Report()

    start = time.perf_counter()
    assets = build_assets(out / "assets", settings)
    split, files = assets["split"], assets["files"]
    base = measure(assets["model"], split["eval"], tokens, seed)
    report.add("untrained", FIGURE, str(base), time.perf_counter() - start)

    # 2. SFT
    start = time.perf_counter()
    sft_dir = train(
        stage_config(
            settings,
            "sft",
            **{
                "model.path": assets["model"],
                "data.train_files": f"[{files['sft_train']}]",
                "data.val_files": f"[{files['sft_val']}]",
            },
        )
    )
    sft_model = sft_dir / "actor_hf"
    sft = measure(sft_model, split["eval"], tokens, seed)
    report.add("sft", FIGURE, str(sft), time.perf_counter() - start)

    # 3. pairs from the SFT model's samples
    start = time.perf_counter()
    k = int(p["samples_per_prompt"])
    train_pairs, pair_stats = [], {}
    for name, offset in (("pair_train", 0), ("pair_val", 1)):
        pairs, stats = sample_pairs(
            sft_model,
            split[name],
            k=k,
            pairs_per_prompt=int(p["pairs_per_prompt"]) if name == "pair_train" else 1,
            max_new_tokens=tokens,
            seed=seed * 1000 + offset,
        )
        write_jsonl(pairs, out / "assets" / f"{name}.jsonl")
        pair_stats[name] = stats
        if name == "pair_train":
            train_pairs = pairs
    train_stats = pair_stats["pair_train"]
    report.add(
        "pairs",
        "kept train/val",
        f"{train_stats.kept}/{pair_stats['pair_val'].kept}",
        time.perf_counter() - start,
    )
    report.add(
        "pairs",
        "chosen/rejected rule",
        f"{train_stats.chosen_reward:.2f}/{train_stats.rejected_reward:.2f}",
        0.0,
    )
    pair_val = f"[{out / 'assets' / 'pair_val.jsonl'}]"
    pair_data = {
        "data.train_files": f"[{out / 'assets' / 'pair_train.jsonl'}]",
        "data.val_files": pair_val,
    }

    # 4. the reward model, on the SFT model's backbone
    start = time.perf_counter()
    rm_dir = train(
        stage_config(
            settings,
            "reward_model",
            **{"model.path": sft_model, "reward.model.model_path": sft_model, **pair_data},
        )
    )
    accuracy = last_value(rm_dir, "val/pair_accuracy") or 0.0
    report.add(
        "reward_model", "held-out pair accuracy", f"{accuracy:.3f}", time.perf_counter() - start
    )
    if accuracy < float(required["reward_model_accuracy"]):
        report.failures.append(
            f"reward model: held-out pair accuracy {accuracy:.3f} < "
            f"{required['reward_model_accuracy']}"
        )

    # 5. RL on the learned reward alone, in rounds: after each, pairs of the RL policy's own
    # samples (ranked by the rule, as the first pairs were) join the reward model's data and it
    # trains on, so that what the policy learned to exploit is labelled (iterated RLHF)
    rounds = int(p["rl_rounds"])
    held_out = {r["prompt"] for r in split["eval"]}
    if rounds < 1:
        raise SystemExit(f"pipeline.rl_rounds must be >= 1, got {rounds}")
    steps = max(1, int(settings["rl"]["run"]["total_steps"]) // rounds)
    policy, reward_model = sft_model, rm_dir / "reward_hf"
    for index in range(1, rounds + 1):
        start = time.perf_counter()
        rl_dir = train(
            stage_config(
                settings,
                "rl",
                **{
                    "model.path": policy,
                    "reference.model_path": sft_model,  # the KL anchor stays the SFT model
                    "reward.model.model_path": reward_model,
                    "data.train_files": f"[{files['rl_train']}]",
                    "data.val_files": f"[{files['rl_val']}]",
                    "run.total_steps": steps,
                    "run.output_dir": out / "rl" / f"round_{index}",
                },
            )
        )
        policy = rl_dir / "actor_hf"
        figure = measure(policy, split["eval"], tokens, seed)
        report.add(
            "rl", f"round {index} {FIGURE}", f"{figure} ({figure.gain(sft)})",
            time.perf_counter() - start,
        )  # fmt: skip
        if index == rounds:
            break
        start = time.perf_counter()
        fresh, stats = sample_pairs(
            policy,
            round_prompts(settings, index, held_out),
            k=k,
            pairs_per_prompt=int(p["pairs_per_prompt"]),
            max_new_tokens=tokens,
            seed=seed * 1000 + 10 + index,
        )
        train_pairs += fresh
        pair_file = write_jsonl(train_pairs, out / "assets" / f"pair_train_round_{index}.jsonl")
        rm_round = train(
            stage_config(
                settings,
                "reward_model",
                **{
                    "model.path": sft_model,
                    "reward.model.model_path": reward_model,  # trains on from the last one
                    "data.train_files": f"[{pair_file}]",
                    "data.val_files": pair_val,
                    "run.total_steps": int(p["round_reward_model_steps"]),
                    "run.val_every": int(p["round_reward_model_steps"]),
                    "run.output_dir": out / "reward_model" / f"round_{index}",
                },
            )
        )
        reward_model = rm_round / "reward_hf"
        round_accuracy = last_value(rm_round, "val/pair_accuracy") or 0.0
        report.add(
            "reward_model",
            f"round {index}: +{stats.kept} policy pairs, held-out pair accuracy",
            f"{round_accuracy:.3f}",
            time.perf_counter() - start,
        )
    rl = figure
    if rl.sampled - sft.sampled < float(required["rl_gain"]):
        report.failures.append(
            f"RL: sampled {rl.sampled:.3f} is not {required['rl_gain']} above SFT's "
            f"{sft.sampled:.3f}"
        )

    # 6. DPO on the SFT model's pairs, against it
    start = time.perf_counter()
    dpo_dir = train(stage_config(settings, "dpo", **{"model.path": sft_model, **pair_data}))
    dpo = measure(dpo_dir / "actor_hf", split["eval"], tokens, seed)
    report.add("dpo", FIGURE, f"{dpo} ({dpo.gain(sft)})", time.perf_counter() - start)
    if dpo.sampled - sft.sampled <= float(required["dpo_gain"]):
        report.failures.append(
            f"DPO: sampled {dpo.sampled:.3f} is not above SFT's {sft.sampled:.3f}"
        )

    print(report.table(time.perf_counter() - began))
    for failure in report.failures:
        print(f"pipeline demo: MISSED: {failure}")
    if not report.failures:
        print("pipeline demo: every stage reached its figure")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
