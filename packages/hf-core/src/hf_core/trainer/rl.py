"""The single-controller RL loop (HybridFlow §4): one driver program over worker groups.

Each step: generate (hybrid engine) -> reference log-probs, values, reward/cost scores in
parallel (futures) -> advantages on the driver -> critic update -> actor update -> weight sync.
Where the samples come from is a :class:`~hf_core.trainer.rollout_source.RolloutSource`: the
actor's own rollout engine, or a standalone rollout pool that may generate the next batches
while the actor trains (``rollout.max_staleness``, asynchronous RL).
The algorithm is chosen by configuration (advantage estimator, policy loss, KL mode), so PPO,
GRPO, ReMax, RLOO, REINFORCE++ and Safe-RLHF are this one loop with different settings.

Self-healing: a worker that dies or hangs (:class:`~hf_core.runtime.WorkerLostError`) makes
the controller tear the groups down, spawn them again and resume from the run's latest
checkpoint (step 0 if it has none yet), up to ``run.max_restarts`` times.  A Python exception
raised by worker code (:class:`~hf_core.runtime.WorkerError`) is not retried: the same code
would raise it again.  Neither is anything raised on the driver (config, data, reward code).
Checkpoints come every ``run.save_every`` steps and also once ``run.save_every_minutes``
passed since the last one, so a fault loses at most that much work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from hf_core.agents.loop import agent_metrics
from hf_core.agents.sandbox_choice import use_sandbox
from hf_core.algorithms import (
    LagrangeMultiplier,
    apply_kl_penalty,
    compute_advantage,
    get_estimator_traits,
    make_kl_controller,
    masked_mean,
    overlong_penalty,
    safe_rlhf_advantage,
    token_level_rewards,
    truncated_responses,
)
from hf_core.algorithms.distill import reverse_kl_advantage
from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.data import DataError, PromptDataset, PromptLoader
from hf_core.engines import rank_zero_row, tensor_nbytes, token_ids
from hf_core.engines.hf_folder import read_model_config
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY
from hf_core.environments import (
    ENV_TASK_KEY,
    Split,
    build_environment,
    runs_rollouts,
    task_metrics,
)
from hf_core.metrics import Timer, peak_memory
from hf_core.multimodal import MULTI_MODAL_KEY, VisionProcessor, is_vision_model
from hf_core.rewards import RuleReward
from hf_core.rng import rng_state, set_rng_state
from hf_core.roles import JUDGE_KEYS
from hf_core.roles.handover import handover_metrics
from hf_core.roles.losses import (
    GROUP_MEAN_MODE,
    distill_loss_keys,
    mismatch_parts,
    mismatch_summary,
)
from hf_core.trainer.batches import generation_input, sampling_params, sft_batch, token_count
from hf_core.trainer.distill_mixing import (
    mix_in_completions,
    mixed_prompts,
    off_policy_prompts,
)
from hf_core.trainer.dynamic_sampling import DynamicSampler
from hf_core.trainer.rollout_source import RolloutSource, StepSamples, rollout_source
from hf_core.trainer.run_loop import RunLoop

log = logging.getLogger(__name__)

ACTOR_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def model_keys(batch: Batch) -> list[str]:
    """What a model forward needs of a batch: :data:`ACTOR_KEYS`, and when the batch has
    them a vision-language model's image features and an MoE rollout's expert choices."""
    extra = [k for k in (MULTI_MODAL_KEY, ROUTED_EXPERTS_KEY) if k in batch]
    return [*ACTOR_KEYS, *extra]


def _rank_zero_metrics(rows: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Rank 0's row of an update's metrics, prefixed: the engines all-reduce them across
    data-parallel ranks, so every rank holds the same numbers and one row is the mean.

    ``rollout/*`` keys (the rollout engine's mismatch, measured in the update's forward)
    keep their own prefix, with the token-weighted mean made from the summed parts.
    """
    row = rank_zero_row(rows)
    out = {f"{prefix}/{k}": v for k, v in row.items() if not k.startswith("rollout/")}
    return out | mismatch_summary(row)


HANDOVER_LOG_STEPS = 100
"""Steps of hand-over events kept in memory (a long run must not grow with them)."""


class RLTrainer(RunLoop):
    """The RL dataflow: owns the rollouts, the rewards and the algorithm's state; the run
    around the steps (cluster, restarts, checkpoints, metrics) is :class:`RunLoop`'s."""

    def __init__(
        self, config: TrainerConfig, *, resume: bool = False, layout: RunLayout | None = None
    ) -> None:
        """``layout``: the recipe's layout as :func:`~hf_core.trainer.preflight.load_run_config`
        returned it with ``config``; ``None``: resolved here, by the pre-start checks."""
        from transformers import AutoTokenizer

        super().__init__(config, resume=resume, layout=layout)
        algo = config.algorithm
        self.recompute_behaviour_log_probs = (
            algo.ppo_epochs > 1 or algo.mini_batches > 1 or algo.kl.mode == "in_reward"
        )
        """On-policy updates (one epoch, one mini-batch) take the behaviour log-probs from the
        update's own forward (ratio exactly 1) instead of a separate pass; off-policy updates,
        and a KL penalty in the reward (needed before the update), keep the recompute."""
        self.masks_samples = config.runs_agent_function or algo.overlong.filter_truncated
        """Whether whole samples may leave the loss (a failed agent run, a filtered truncated
        response): their rows have no valid token, and get no reward."""
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(config.tokenizer_path), local_files_only=True
        )
        data = config.data
        self.environment = (
            build_environment(config.env.model_dump()) if config.env is not None else None
        )
        if not data.train_files and self.environment is None:
            raise DataError("data.train_files is empty: give at least one JSONL/Parquet file")
        dataset_kwargs: dict[str, Any] = dict(
            prompt_key=data.prompt_key,
            ground_truth_key=data.ground_truth_key,
            max_prompt_length=data.max_prompt_length,
            chat_template=data.chat_template,
            image_key=data.image_key,
        )
        if is_vision_model(read_model_config(Path(config.model.path), key="model.path")):
            dataset_kwargs["vision"] = VisionProcessor(
                config.model.path, self.tokenizer, data.max_image_tokens
            )
        self.train_set, val_set = self._prompt_sets(dataset_kwargs)
        self.val_loader = (
            PromptLoader.for_validation(val_set, data.val_batch_size) if val_set else None
        )
        use_sandbox(config.sandbox)  # rule-based rewards (code_tests) run their code there
        env = self.environment
        reward_function = (  # an environment running its own episodes returns their rewards
            config.reward.function if env is None else None if runs_rollouts(env) else env.score
        )
        self.reward_fn = RuleReward(reward_function, self.tokenizer) if reward_function else None
        self.cost_fn = (
            RuleReward(config.cost.function, self.tokenizer)
            if config.cost is not None and config.cost.function
            else None
        )
        self.sampler: DynamicSampler | None = None
        """Dynamic sampling (``algorithm.dynamic_sampling``), while fit() runs."""
        self._rollouts: RolloutSource | None = None
        self._new_run_state()

    def _prompt_sets(
        self, dataset_kwargs: dict[str, Any]
    ) -> tuple[PromptDataset, PromptDataset | None]:
        """The training and validation prompts: the environment's splits, or the files."""
        env, data = self.environment, self.config.data

        def prompts(split: Split, files: list[Path]) -> PromptDataset | None:
            if env is not None:
                records = env.records(split)
                if not records:
                    return None
                return PromptDataset(
                    records, self.tokenizer, name=f"env: {split}", **dataset_kwargs
                )
            if not files:
                return None
            paths = [str(p) for p in files]
            return PromptDataset.from_files(paths, self.tokenizer, **dataset_kwargs)

        train = prompts("train", data.train_files)
        if train is None:
            raise DataError("the environment gave no training prompts (env.size)")
        return train, prompts("val", data.val_files)

    def _new_run_state(self) -> None:
        """The driver's training state at step 0 (a restart with no checkpoint goes back here)."""
        config = self.config
        self.loader = PromptLoader(
            self.train_set,
            config.data.batch_size,
            shuffle=config.data.shuffle,
            seed=config.run.seed,
            num_epochs=config.data.num_epochs,
        )
        kl = config.algorithm.kl
        self.kl_ctl = make_kl_controller(
            kl.controller, kl_coef=kl.coef, target_kl=kl.target, horizon=kl.horizon
        )
        self.lagrange = (
            LagrangeMultiplier(
                config.algorithm.lagrange_init,
                lr=config.algorithm.lagrange_lr,
                cost_limit=config.algorithm.cost_limit,
            )
            if config.cost is not None
            else None
        )
        self.step = 0
        self.handover_log: deque[dict[str, Any]] = deque(maxlen=HANDOVER_LOG_STEPS)
        """Per step, rank 0's memory hand-over events in order (engine, action, bytes): the
        last HANDOVER_LOG_STEPS steps (the metrics carry every step's totals)."""

    @property
    def rollouts(self) -> RolloutSource:
        if self._rollouts is None:
            raise RuntimeError("the rollout source exists only while fit() runs")
        return self._rollouts

    # ------------------------------------------------------- the run's hooks
    def _after_groups(self) -> None:
        self._rollouts = None

    def _has_validation(self) -> bool:
        return self.val_loader is not None

    def _start_attempt(self) -> None:
        cfg = self.config
        self._rollouts = rollout_source(cfg, self._groups, self.loader)
        dynamic = cfg.algorithm.dynamic_sampling
        self.sampler = (
            DynamicSampler(
                self._rollouts,
                batch_size=cfg.data.batch_size,
                group_size=cfg.rollout.n,
                max_rounds=dynamic.max_rounds,
                join=self._samples_batch,
                score=self._score,
            )
            if dynamic.enabled
            else None
        )

    def _before_training(self, resumed_step: int | None) -> None:
        if resumed_step is None and self.config.sft.steps:
            self._warm_start()

    def _end_attempt(self, failure: BaseException | None) -> None:
        self.rollouts.write_account(self.output_dir, len(self.start_steps), failure)

    def _export(self) -> None:
        self._groups.actor.export_hf(str(self.output_dir / "actor_hf"))

    # --------------------------------------------------------------- stages
    def _train_step(self) -> dict[str, float]:
        cfg, roles = self.config, self._groups
        algo = cfg.algorithm
        metrics: dict[str, float] = {}
        start = time.perf_counter()

        with Timer("generate", metrics):  # with a pool running ahead: the wait for samples
            samples = self.rollouts.take(self.step)
        metrics.update(self.rollouts.take_metrics())
        metrics.update(agent_metrics(samples.generated))
        prompts, batch = samples.prompts, self._samples_batch(samples)
        filtered_scores: torch.Tensor | None = None
        if self.sampler is not None:
            with Timer("dynamic_sampling", metrics):  # scores and refills the batch
                filled = self.sampler.fill(self.step, samples)
            prompts, batch, filtered_scores = filled.prompts, filled.batch, filled.scores
            metrics.update(filled.metrics)
            metrics.update(self.rollouts.take_metrics())
        batch.meta.update(step=self.step, temperature=cfg.rollout.temperature or 1.0)
        off_policy: torch.Tensor | None = None
        if cfg.teacher is not None and algo.distill.on_policy_share < 1.0:
            with Timer("distill_mixing", metrics):
                prompts, batch, off_policy = self._mix_completions(prompts, batch, samples.version)
            metrics["distill/off_policy_share"] = float(off_policy.float().mean())
        model_input = batch.select(*model_keys(batch))
        model_input.meta.update(batch.meta)

        with Timer("prepare", metrics):
            futures = {}
            if self.recompute_behaviour_log_probs:
                futures["old"] = roles.actor.compute_log_probs.remote(model_input)
            if cfg.reference is not None:
                futures["ref"] = roles.actor.compute_ref_log_probs.remote(model_input)
            if cfg.teacher is not None:
                futures["teacher"] = roles.actor.compute_teacher_log_probs.remote(model_input)
            if roles.critic is not None:
                futures["values"] = roles.critic.compute_values.remote(model_input)
            if roles.reward is not None and filtered_scores is None:
                futures["reward"] = roles.reward.compute_scores.remote(self._reward_input(batch))
            if roles.cost is not None:
                futures["cost"] = roles.cost.compute_scores.remote(model_input)
            scores = (  # the rule reward overlaps with the futures
                filtered_scores if filtered_scores is not None else self._task_scores(batch)
            )
            costs = self._rule_scores(batch, self.cost_fn)
            for future in futures.values():
                batch = batch | future.result()
            if "reward_scores" in batch:
                scores = batch["reward_scores"] + (0 if scores is None else scores)
            if "cost_scores" in batch:
                costs = batch["cost_scores"] + (0 if costs is None else costs)
            if scores is None and cfg.teacher is not None:  # distillation alone
                scores = torch.zeros(len(batch))
            if scores is None:  # the config requires reward.function or reward.model
                raise RuntimeError("no reward was computed: set reward.function or reward.model")
            baseline = (
                self._greedy_baseline(prompts)
                if get_estimator_traits(algo.advantage).needs_greedy_baseline
                else None
            )

        with Timer("advantage", metrics):
            task_scores = scores  # logged as reward/mean: the task's own measure
            scores = self._shape_lengths(batch, scores * cfg.reward.weight, metrics)
            mask = batch["response_mask"]
            if algo.kl.mode == "in_reward":
                rewards, kl_metrics = apply_kl_penalty(
                    scores,
                    batch["old_log_probs"],  # recomputed whenever the KL is in the reward
                    batch["ref_log_probs"],
                    mask,
                    kl_coef=self.kl_ctl.value,
                    estimator=algo.kl.estimator,
                    allow_empty=self.masks_samples,
                )
                metrics.update({f"actor/{k}": v for k, v in kl_metrics.items()})
                self.kl_ctl.update(kl_metrics["kl/token_mean"], len(batch))
            else:
                rewards = token_level_rewards(scores, mask, allow_empty=self.masks_samples)
            advantages, returns = self._advantages(algo.advantage, rewards, mask, batch, baseline)
            if costs is not None and self.lagrange is not None:
                # No cost critic: cost advantages come from a critic-free estimator.
                cost_rewards = token_level_rewards(costs, mask, allow_empty=self.masks_samples)
                cost_adv, _ = self._advantages(algo.cost_advantage, cost_rewards, mask, batch, None)
                advantages = safe_rlhf_advantage(advantages, cost_adv, self.lagrange.value, mask)
                metrics["cost/mean"] = float(costs.mean())
                metrics["cost/lagrange"] = self.lagrange.update(float(costs.mean()))
            if cfg.teacher is not None:
                advantages = self._distill(batch, advantages, metrics)
            if off_policy is not None:  # dataset completions: the teacher's signal only
                advantages = advantages.masked_fill(off_policy[:, None], 0.0)
                task_scores = task_scores[~off_policy]  # the student's own samples measured
            batch["advantages"], batch["returns"] = advantages, returns

        if roles.critic is not None:
            with Timer("update_critic", metrics):
                update = batch.select(*model_keys(batch), "returns", *self._loss_group_keys())
                update["old_values"] = batch["values"]
                update.meta.update(batch.meta)
                metrics.update(_rank_zero_metrics(roles.critic.update_critic(update), "critic"))
        with Timer("update_actor", metrics):
            # Without a recompute the update's own forward is the behaviour policy (ratio 1)
            # and reports the rollout engine's mismatch from that same forward.
            # The rollout log-probs also weight the loss when samples may be off-policy.
            keys = [*model_keys(batch), "rollout_log_probs", "advantages"]
            if "old_log_probs" in batch:
                keys.append("old_log_probs")
            if algo.kl.mode == "in_loss":
                keys.append("ref_log_probs")
            if cfg.teacher is not None:
                keys.extend(distill_loss_keys(algo.distill))
            keys.extend(self._loss_group_keys())
            update = batch.select(*keys)
            update.meta.update(batch.meta)
            updated = roles.actor.update_actor.remote(update)
            finish_sync = self.rollouts.queue_after_update(self.step)
            metrics.update(_rank_zero_metrics(updated.result(), "actor"))
        with Timer("weight_sync", metrics):
            metrics.update(finish_sync())
        handover = roles.actor.take_handover_log()
        self.handover_log.append({"step": self.step, "events": handover[0]["events"]})
        metrics.update(handover_metrics(handover))

        elapsed = time.perf_counter() - start
        lengths = mask.sum(-1).float()
        metrics.update(
            {
                "reward/mean": float(task_scores.mean()),
                "reward/std": float(task_scores.std()) if len(task_scores) > 1 else 0.0,
                "advantage/mean": float(masked_mean(advantages, mask)),
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "perf/step_s": elapsed,
                "perf/tokens": float(token_count(batch)),
                "perf/throughput": token_count(batch) / elapsed,
                **peak_memory(),
            }
        )
        if ENV_TASK_KEY in batch.non_tensors and off_policy is None:  # each task on its own
            turns = batch["agent_turns"].tolist() if "agent_turns" in batch else None
            tasks = batch.non_tensors[ENV_TASK_KEY]
            metrics.update(task_metrics(tasks, task_scores.tolist(), turns=turns))
        if ROUTED_EXPERTS_KEY in batch:  # what routing replay adds to the step's batch
            metrics["moe/routing_bytes"] = float(tensor_nbytes(batch[ROUTED_EXPERTS_KEY]))
        if "old_log_probs" in batch:  # recomputed: the mismatch is measured here
            parts = mismatch_parts(batch["old_log_probs"], batch["rollout_log_probs"], mask)
            metrics.update(mismatch_summary(parts))
        if "ref_log_probs" in batch:
            behaviour = batch["old_log_probs" if "old_log_probs" in batch else "rollout_log_probs"]
            metrics["actor/kl"] = float(masked_mean(behaviour - batch["ref_log_probs"], mask))
        return metrics

    def _shape_lengths(
        self, batch: Batch, scores: torch.Tensor, metrics: dict[str, float]
    ) -> torch.Tensor:
        """DAPO's overlong shaping (``algorithm.overlong``): the soft length penalty added to
        the scores, and truncated responses masked out of the loss if asked.  Reports the
        share of responses cut at ``rollout.max_new_tokens`` either way."""
        overlong, limit = self.config.algorithm.overlong, self.config.rollout.max_new_tokens
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        stops = [*self.config.rollout.stop_token_ids, *token_ids(self.tokenizer.eos_token_id)]
        truncated = truncated_responses(batch["responses"], mask, limit, stops)
        metrics["response_length/truncated_frac"] = float(truncated.float().mean())
        if overlong.filter_truncated:
            batch["response_mask"] = mask * (~truncated).to(mask.dtype).unsqueeze(-1)
            metrics["overlong/filtered"] = float(truncated.sum())
        if not overlong.buffer:
            return scores
        penalty = overlong_penalty(lengths, limit, overlong.buffer, overlong.penalty_factor)
        metrics["overlong/penalty_mean"] = float(penalty.mean())
        return scores + penalty.to(scores.dtype)

    def _distill(
        self, batch: Batch, advantages: torch.Tensor, metrics: dict[str, float]
    ) -> torch.Tensor:
        """On-policy distillation: the teacher's per-token signal, in the advantage (``loss:
        reverse_kl``, ``mode: advantage``) or measured only (the actor's loss carries it)."""
        distill = self.config.algorithm.distill
        student = batch["old_log_probs" if "old_log_probs" in batch else "rollout_log_probs"]
        shaped, found = reverse_kl_advantage(
            advantages, student, batch["teacher_log_probs"], batch["response_mask"], distill.coef
        )
        metrics.update(found)
        in_advantage = distill.loss == "reverse_kl" and distill.mode == "advantage"
        return shaped if in_advantage else advantages

    def _mix_completions(
        self, prompts: Batch, batch: Batch, version: int
    ) -> tuple[Batch, Batch, torch.Tensor]:
        """GKD's mix (:mod:`hf_core.trainer.distill_mixing`): some prompts' samples replaced by
        their dataset completion, whose rollout log-probs are the student's own."""
        cfg = self.config
        distill = cfg.algorithm.distill
        off = off_policy_prompts(len(prompts), distill.on_policy_share, cfg.run.seed, self.step)
        mixed = mix_in_completions(
            batch,
            prompts,
            off,
            n=cfg.rollout.n,
            tokenizer=self.tokenizer,
            completion_key=distill.completion_key,
            version=version,
        )
        rows = torch.nonzero(mixed.off_policy).flatten()
        if len(rows):
            part = mixed.batch.index(rows)
            student = part.select(*model_keys(part))
            student.meta.update(batch.meta)
            log_probs = self._groups.actor.compute_log_probs(student)["old_log_probs"]
            mixed.batch["rollout_log_probs"][rows] = log_probs.to(
                mixed.batch["rollout_log_probs"].dtype
            )
        return mixed_prompts(prompts, off), mixed.batch, mixed.off_policy

    def _loss_group_keys(self) -> tuple[str, ...]:
        """The batch keys the loss needs beyond the model's inputs: ``group_index`` when the
        aggregation weighs each prompt's group as one (its rows are weighted by their group's
        share of the mini-batch's tokens, which needs to know which rows share a prompt)."""
        return ("group_index",) if self.config.algorithm.loss_agg_mode == GROUP_MEAN_MODE else ()

    def _samples_batch(self, samples: StepSamples) -> Batch:
        """One draw's samples joined with their prompts' fields, group-major."""
        n = self.config.rollout.n
        prompts = samples.prompts
        per_sample = prompts.select(*prompts.non_tensors.keys()).repeat_interleave(n)
        batch = samples.generated | per_sample
        batch["group_index"] = torch.arange(len(prompts)).repeat_interleave(n)
        if "policy_version" not in batch:  # streaming tags each sample with its oldest token's
            batch["policy_version"] = torch.full((len(batch),), samples.version)
        return batch

    def _reward_input(self, batch: Batch) -> Batch:
        """What the reward role reads: the actor's tensors, plus prompt and ground truth for a
        judge."""
        judge_keys = JUDGE_KEYS if self.config.reward.judge is not None else ()
        return batch.select(*model_keys(batch), *(k for k in judge_keys if k in batch))

    def _rule_scores(self, batch: Batch, fn: RuleReward | None) -> torch.Tensor | None:
        return None if fn is None else fn(batch).float()

    def _task_scores(self, batch: Batch) -> torch.Tensor | None:
        """The rule-based reward plus what an agent function returned (``agent.function``);
        None when the run has neither."""
        scores = self._rule_scores(batch, self.reward_fn)
        if "agent_reward" in batch:
            agent = torch.as_tensor(batch["agent_reward"]).float()
            scores = agent if scores is None else scores + agent
        return scores

    def _advantages(
        self,
        name: str,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        batch: Batch,
        baseline: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        algo = self.config.algorithm
        inputs: dict[str, Any] = dict(
            index=batch["group_index"],
            gamma=algo.gamma,
            lam=algo.lam,
            norm_by_std=algo.norm_by_std,
        )
        if "values" in batch:
            inputs["values"] = batch["values"]
        if baseline is not None:
            inputs["baseline_scores"] = baseline
        return compute_advantage(name, rewards, mask, **inputs)

    def _greedy_baseline(self, prompts: Batch) -> torch.Tensor:
        """ReMax: the reward of the greedy response to each prompt, repeated over its group."""
        params = sampling_params(self.config.rollout, self.step, self.config.run.seed, greedy=True)
        greedy = self.rollouts.generate_now(generation_input(prompts, self.config), params)
        greedy = greedy | prompts.select(*prompts.non_tensors.keys())
        return self._score(greedy).repeat_interleave(self.config.rollout.n)

    def _score(self, batch: Batch) -> torch.Tensor:
        """Rule-based plus reward-model scores of a batch (blocking; outside the main step);
        zeros when the run has no reward (distillation alone)."""
        scores = self._task_scores(batch)
        if self._groups.reward is not None:
            model = self._groups.reward.compute_scores(self._reward_input(batch))["reward_scores"]
            scores = model if scores is None else scores + model
        return torch.zeros(len(batch)) if scores is None else scores

    def _has_reward(self) -> bool:
        reward = self.config.reward
        has = reward.function or reward.model or reward.judge or self.environment is not None
        return bool(has or self.config.runs_agent_function)

    # ----------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Greedy (by default) generations on the validation set; their mean reward."""
        if self.val_loader is None or not self._has_reward():
            return {}
        params = sampling_params(self.config.rollout, 0, self.config.run.seed, n=1)
        params = params.model_copy(update={"temperature": self.config.rollout.val_temperature})
        scores, tasks = [], []
        for prompts in self.val_loader:
            generated = self.rollouts.generate_now(generation_input(prompts, self.config), params)
            scores.append(self._score(generated | prompts.select(*prompts.non_tensors)))
            tasks += list(prompts.non_tensors.get(ENV_TASK_KEY, ()))
        every = torch.cat(scores).float()
        out = {"val/reward_mean": float(every.mean())}
        if len(tasks) == len(every):  # an environment's validation table, task by task
            out.update(task_metrics(tasks, every.tolist(), prefix="val/env"))
        return out

    # ----------------------------------------------------------------- SFT
    def _warm_start(self) -> None:
        """Supervised steps on (prompt, ground truth) before RL, from the same data."""
        cfg = self.config
        loader = PromptLoader(
            self.train_set,
            cfg.sft.batch_size,
            shuffle=True,
            seed=cfg.run.seed + 1,
            num_epochs=1_000_000,
        )
        for i in range(1, cfg.sft.steps + 1):
            batch = sft_batch(next(loader), self.tokenizer, cfg.sft.target_key)
            rows = self._groups.actor.sft_step(batch)
            if i == 1 or i % 10 == 0 or i == cfg.sft.steps:
                log.info("SFT step %d/%d: nll %.3f", i, cfg.sft.steps, rows[0]["sft_nll"])
        self.rollouts.sync(version=0)

    # --------------------------------------------------------- checkpoints
    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loader": self.rollouts.loader_state(),  # before any prompts still in flight
            "rollouts": self.rollouts.state_dict(),  # streaming: the prompt ledger
            "kl_ctl": self.kl_ctl.state_dict(),
            "lagrange": self.lagrange.state_dict() if self.lagrange else None,
            "rng": rng_state(),  # JSON values and tensors: nothing pickled
        }

    def _save_engines(self, folder: Path) -> None:
        self._groups.actor.save_checkpoint(str(folder))
        if self._groups.critic is not None:
            self._groups.critic.save_checkpoint(str(folder))

    def _load(self, folder: Path, state: dict[str, Any]) -> None:
        self._groups.actor.load_checkpoint(str(folder), int(state["step"]))
        if self._groups.critic is not None:
            self._groups.critic.load_checkpoint(str(folder))
        self.step = int(state["step"])
        self.rollouts.sync(version=self.step)
        self.loader.load_state_dict(state["loader"])
        self.rollouts.load_state_dict(state.get("rollouts") or {})
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.lagrange is not None and state["lagrange"] is not None:
            self.lagrange.load_state_dict(state["lagrange"])
        set_rng_state(state["rng"])
