"""The typed run configuration: what a recipe YAML may say, with defaults and bounds.

Core validates what core uses; each engine's own keyword settings (``engine:`` blocks) are
validated by that backend's config class when the engine is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from hf_core.agents.config import AgentConfig, SandboxConfig

AbsPath = Annotated[Path, AfterValidator(lambda p: p.expanduser().absolute())]
"""Paths are made absolute against the driver's working directory, because worker
processes (possibly on other nodes) do not share it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunConfig(_Strict):
    name: str = "run"
    output_dir: AbsPath = Field(Path("runs/run"), description="metrics, plot, checkpoints, exports")
    total_steps: int = Field(10, ge=1, description="RL steps (one batch of prompts each)")
    seed: int = 0
    val_every: int = Field(0, ge=0, description="validate every N steps (0: never)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    save_final: bool = Field(True, description="checkpoint after the last step")
    save_every_minutes: float | None = Field(
        30.0,
        gt=0,
        description="also checkpoint when this many minutes passed since the last one "
        "(None: off), so a fault loses at most that much work",
    )
    keep_checkpoints: int = Field(
        3, ge=1, description="checkpoints kept on disk (the newest; 'latest' is never deleted)"
    )
    max_restarts: int = Field(
        2,
        ge=0,
        description="when a worker dies or hangs: tear down, restart the groups and resume from "
        "the latest checkpoint this many times before giving up",
    )
    export_final: bool = Field(
        False,
        description="export the trained model as an HF folder at the end (actor_hf; reward_hf "
        "under trainer: reward_model)",
    )
    tensorboard: bool = False
    wandb: bool = False
    progress: bool = True
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker process; None: the node's cores shared "
        "evenly by the run's processes",
    )


class ClusterConfig(_Strict):
    address: str | None = Field(None, description="join this Ray cluster (or RAY_ADDRESS)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local Ray instance")
    use_gpu: bool | Literal["auto"] = Field(
        "auto",
        description="one GPU per rank; auto: when the Ray cluster has GPUs (Ray hides the GPUs "
        "from a worker that asks for none, so without this a GPU machine trains on its CPUs)",
    )
    failure_timeout_s: float = Field(
        30.0, gt=0, description="a dead or frozen worker is reported within this many seconds"
    )


class PlacementConfig(_Strict):
    """Where the roles run.

    ``colocate``: one pool of ``processes`` ranks hosts every role (the paper's default);
    ``split``: the actor (with rollout and reference) on ``processes`` ranks, and critic and
    reward/cost models on a second pool of ``other_processes`` ranks;
    ``auto``: the auto-mapping planner (paper §6) chooses the pools over ``devices`` devices of
    kind ``device`` (``processes`` is then the actor pool's size it picked);
    ``standalone``: every model role on ``processes`` ranks and the rollout engines on a pool
    of their own of ``rollout_processes`` ranks, weights broadcast to it after each update
    (what lets generation overlap training: ``rollout.max_staleness``).
    """

    mode: Literal["colocate", "split", "auto", "standalone"] = "colocate"
    processes: int = Field(1, ge=1)
    other_processes: int = Field(1, ge=1)
    rollout_processes: int = Field(
        1, ge=1, description="standalone: ranks of the rollout pool (one whole-model engine each)"
    )
    nodes: int = Field(
        1,
        ge=1,
        description="colocate / split: spread each pool's ranks evenly over this many Ray "
        "nodes (one placement group per node; ranks are numbered node by node)",
    )
    devices: int | None = Field(None, ge=1, description="auto: devices to plan over")
    device: str = Field("cpu", description="auto: device profile (cpu, a100-80g, h100, h200)")


class DataConfig(_Strict):
    train_files: list[AbsPath] = Field(default_factory=list)
    val_files: list[AbsPath] = Field(default_factory=list)
    prompt_key: str = "prompt"
    ground_truth_key: str = "ground_truth"
    max_prompt_length: int | None = Field(None, ge=1)
    chat_template: bool | None = Field(None, description="None: use it if the tokenizer has one")
    batch_size: int = Field(8, ge=1, description="prompts per RL step")
    val_batch_size: int = Field(32, ge=1)
    shuffle: bool = True
    num_epochs: int = Field(1000, ge=1, description="passes over the data (steps stop first)")
    image_key: str = Field(
        "images",
        description="vision-language models: the record field with its image(s) (paths "
        "relative to the data file, bytes, data URLs); prompts mark each with <image>",
    )
    max_image_tokens: int | None = Field(
        None,
        ge=1,
        description="vision-language models: the most image tokens one image may take (a "
        "larger image is an error naming its record); None: the model's "
        "max_position_embeddings",
    )


class KLConfig(_Strict):
    mode: Literal["none", "in_reward", "in_loss"] = "none"
    estimator: str = Field(
        "k3", description="a registered KL estimator (built in: k1, k2, k3, abs; or a plugin's)"
    )
    coef: float = Field(0.001, ge=0.0)
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = Field(6.0, gt=0.0, description="adaptive controller's target KL")
    horizon: int = Field(10000, ge=1)


class OverlongConfig(_Strict):
    """DAPO's overlong reward shaping (arXiv 2503.14476 §3.4): a length penalty ramping from 0
    at rollout.max_new_tokens - buffer to -penalty_factor at max_new_tokens
    (:func:`hf_core.algorithms.overlong_penalty`)."""

    buffer: int = Field(
        0,
        ge=0,
        description="L_cache: the last tokens before rollout.max_new_tokens, over which the "
        "penalty ramps up (0: off); must be < rollout.max_new_tokens",
    )
    penalty_factor: float = Field(1.0, ge=0.0, description="scale of the penalty (DAPO: 1)")
    filter_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: truncated responses (cut at "
        "rollout.max_new_tokens) are left out of the loss",
    )


class DynamicSamplingConfig(_Strict):
    """DAPO's dynamic sampling (arXiv 2503.14476 §3.2): prompt groups whose rewards all agree
    carry no group-relative advantage, so they are filtered out and more prompts are drawn
    until ``data.batch_size`` groups with differing rewards are in hand."""

    enabled: bool = False
    max_rounds: int = Field(
        4,
        ge=0,
        description="extra generation rounds per step at most; if the batch is still short "
        "then, it is filled with filtered groups (counted in dynamic_sampling/short_groups)",
    )


class DistillConfig(_Strict):
    """Distillation from the ``teacher`` role (Agarwal et al. 2024, GKD, "On-Policy
    Distillation of Language Models", arXiv 2306.13649; Gu et al. 2024, MiniLLM, arXiv
    2306.08543).  ``loss: reverse_kl``: the student samples, the teacher scores every sampled
    token, and the per-token reverse KL log pi_student - log pi_teacher is minimised.  The
    top-k losses match the teacher's next-token distribution, truncated to its ``top_k``
    likeliest tokens per position, at every response token (docs/algorithms.md)."""

    loss: Literal["reverse_kl", "forward_kl_topk", "jsd"] = Field(
        "reverse_kl",
        description="reverse_kl: one teacher log-prob per sampled token (see mode); "
        "forward_kl_topk: KL(teacher || student) over the teacher's top-k; jsd: GKD's "
        "generalized Jensen-Shannon divergence with 'beta' over the teacher's top-k",
    )
    coef: float = Field(1.0, gt=0.0, description="weight of the distillation signal")
    mode: Literal["advantage", "loss"] = Field(
        "advantage",
        description="loss reverse_kl: advantage: coef * (log pi_teacher - log pi_student) is "
        "added to each token's advantage (the REINFORCE form of the reverse-KL gradient); "
        "loss: coef * KL(student || teacher), estimated per token with 'estimator', is added "
        "to the loss.  The top-k losses are always loss terms",
    )
    estimator: str = Field(
        "k2",
        description="loss mode: a registered KL estimator (k2's gradient on the student's own "
        "samples is the reverse KL's)",
    )
    top_k: int = Field(
        64,
        ge=1,
        description="top-k losses: the teacher's likeliest tokens per position it returns",
    )
    beta: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="jsd: the teacher's weight in the mixture (toward 0 the divergence "
        "behaves like forward KL, toward 1 like reverse KL)",
    )
    tail: Literal["bucket", "renormalize"] = Field(
        "bucket",
        description="top-k losses: the probability outside the teacher's top-k as one more "
        "category for each model (bucket), or both distributions renormalised over the "
        "top-k (renormalize)",
    )
    top_k_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the dtype the teacher's top-k log-probs are kept in (its ids take the "
        "smallest integer type the vocabulary allows)",
    )
    on_policy_share: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="GKD's lambda: the share of each step's prompts answered by the student's "
        "own samples; the others take their dataset completion ('completion_key'), scored "
        "by the teacher the same way (top-k losses only)",
    )
    completion_key: str = Field(
        "ground_truth",
        description="on_policy_share < 1: the dataset field with a prompt's completion text",
    )

    @model_validator(mode="after")
    def _mixing_needs_a_top_k_loss(self) -> DistillConfig:
        if self.on_policy_share < 1.0 and self.loss == "reverse_kl":
            raise ValueError(
                "on_policy_share < 1 mixes in dataset completions, which only a top-k loss "
                "(forward_kl_topk or jsd) can learn from: reverse_kl scores the student's own "
                "samples"
            )
        return self


class AlgorithmConfig(_Strict):
    advantage: str = Field("grpo", description="a registered advantage estimator")
    cost_advantage: str = Field(
        "reinforce_plus_plus",
        description="Safe-RLHF: estimator for cost advantages (there is no cost critic)",
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    norm_by_std: bool = True
    policy_loss: str = Field("ppo_clip", description="a registered policy loss")
    clip_ratio_low: float = Field(
        0.2, gt=0.0, le=1.0, description="ε_low: ratio >= 1 - ε_low (1: no lower bound, CISPO)"
    )
    clip_ratio_high: float = Field(0.2, gt=0.0)
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip bound")
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = Field(0.0, ge=0.0)
    value_clip: float = Field(0.2, gt=0.0)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch")
    kl: KLConfig = Field(default_factory=KLConfig)
    rollout_is: Literal["auto", "truncated", "masked", "seq_truncated", "seq_masked", "none"] = (
        Field(
            "auto",
            description="rollout correction on the policy loss.  Per token: truncated: "
            "importance weights pi_old / pi_rollout capped at rollout_is_cap; masked: tokens "
            "whose ratio leaves [1/cap, cap] are dropped from the loss.  Per sequence: "
            "seq_truncated: the response's ratio (product over its tokens) capped at "
            "rollout_is_cap, on each of its tokens; seq_masked: responses whose geometric-mean "
            "ratio leaves [1/cap, cap] are dropped.  auto: truncated when "
            "rollout.max_staleness > 0 or the actor or rollout engine runs in 16-bit floats",
        )
    )
    rollout_is_cap: float = Field(
        2.0, gt=1.0, description="truncation cap (and masking band) of the rollout IS ratio"
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig,
        description="DAPO's overlong reward shaping (buffer 0: off)",
    )
    distill: DistillConfig = Field(
        default_factory=DistillConfig,
        description="on-policy distillation settings (active when a 'teacher' is given)",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig,
        description="DAPO's dynamic sampling: train only on groups whose rewards differ",
    )
    router_replay: Literal["rollout", "off"] = Field(
        "rollout",
        description="mixture-of-experts models: rollout: every training forward of a rollout's "
        "tokens (old log-probs, reference, update) routes each token to the experts the "
        "rollout engine chose (R3; docs/moe.md); off: the trainer's router decides.  Dense "
        "models have nothing to replay",
    )
    moe_aux_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="mixture-of-experts models: weight of the load-balancing loss in the "
        "actor's loss (Switch: num_experts x sum_e f_e P_e per MoE layer over real tokens, f_e "
        "the share of the layer's top-k slots sent to expert e, P_e its mean router "
        "probability; 1.0 when balanced; averaged over layers).  0: off (still reported as "
        "actor/moe/aux_loss; docs/moe.md)",
    )
    moe_z_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="mixture-of-experts models: weight of the router z-loss in the actor's "
        "loss (ST-MoE: mean over real tokens of logsumexp(router logits)^2, averaged over "
        "layers).  0: off (still reported as actor/moe/z_loss)",
    )

    # Safe-RLHF
    cost_limit: float = 0.0
    lagrange_init: float = Field(1.0, ge=0.0)
    lagrange_lr: float = Field(0.05, gt=0.0)

    @field_validator("router_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML 1.1 reads a bare ``off`` as false (and ``on`` as true)."""
        if isinstance(value, bool):
            return "rollout" if value else "off"
        return value


class RolloutConfig(_Strict):
    backend: str = Field("transformers", description="a registered rollout engine")
    n: int = Field(1, ge=1, description="samples per prompt (GRPO/RLOO groups)")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(32, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    val_temperature: float = Field(0.0, ge=0.0, description="validation: 0 is greedy")
    bucket_mb: float = Field(64.0, gt=0, description="weight-sync bucket size")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="t_g: ranks forming one rollout engine (the generation TP of the "
        "3D-HybridEngine); must divide the actor's TP size when the actor is model-parallel",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="p_g: generation pipeline stages (engines that support it)"
    )
    reshard: Literal["hybrid", "naive"] = Field(
        "hybrid",
        description="training -> generation transition of a model-parallel actor: the paper's "
        "micro-DP all-gathers (hybrid, zero redundancy) or whole-replica gathers (naive)",
    )
    sync: Literal["full", "delta"] = Field(
        "full",
        description="standalone pools: each weight sync sends every tensor whole (full) or "
        "only the entries whose bits changed since the last version (delta; both ends keep a "
        "host copy of the weights in the pool's dtype; docs/weight_sync.md)",
    )
    sync_full_every: int = Field(
        10, ge=1, description="delta sync: a full sync every this many policy versions"
    )
    sync_verify: bool = Field(
        False,
        description="every weight stream carries per-tensor checksums the pool checks (a "
        "delta chain's full syncs always do); a mismatch in a delta is healed by a full sync",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="asynchronous RL (placement.mode: standalone): generation runs ahead of "
        "training on samples at most this many policy versions old; 0: the synchronous loop",
    )
    mode: Literal["batch", "streaming"] = Field(
        "batch",
        description="standalone pools: batch generates whole batches (one is trained when its "
        "slowest sample ends); streaming generates continuously, hands each prompt's group over "
        "when its last sample ends, and lets new weights reach responses mid-generation "
        "(partial rollouts, per-token policy versions; docs/async.md)",
    )
    partial_rollouts: bool = Field(
        True,
        description="streaming: new weights reach responses under way at the next token "
        "(their tokens then span versions); false: an update waits until the responses under "
        "way end (no new ones start meanwhile)",
    )
    stream_capacity: int | None = Field(
        None,
        ge=1,
        description="streaming: samples each rollout rank decodes at once (default: a batch's "
        "samples over the pool's ranks)",
    )
    stream_chunk_tokens: int = Field(
        16,
        ge=1,
        description="streaming on an engine without a token-level stream: tokens per generate "
        "call between which weight updates can land (the prefix is recomputed per call)",
    )
    engine: dict[str, Any] = Field(default_factory=dict, description="backend settings")


class ParallelConfig(_Strict):
    """A model role's training layout: ranks splitting one model replica or one sequence.
    The data-parallel size is what is left of the role's pool (``processes / (tp * pp * sp)``)."""

    tp: int = Field(1, ge=1, description="tensor-parallel ranks (backends declaring 'tp')")
    pp: int = Field(1, ge=1, description="pipeline stages (backends declaring 'pp')")
    sp: int = Field(
        1,
        ge=1,
        description="sequence-parallel ranks splitting each sequence's tokens (Ulysses: "
        "attention by heads after an all-to-all; backends declaring 'sp')",
    )
    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel ranks: a mixture-of-experts model's experts split over "
        "this many of the data-parallel ranks (backends declaring 'ep')",
    )


class ModelRoleConfig(_Strict):
    """A model role: which training backend, which weights, its layout, backend settings."""

    backend: str = Field("fsdp", description="a registered training engine")
    model_path: AbsPath | None = Field(None, description="default: model.path")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="training layout (tp, pp, sp); placement.mode: auto fills tp and pp "
        "where not set",
    )
    engine: dict[str, Any] = Field(default_factory=dict, description="backend settings")


class ModelConfig(_Strict):
    path: AbsPath = Field(description="the policy's initial weights (a local HF folder)")
    tokenizer_path: AbsPath | None = Field(None, description="default: model.path")


class JudgeConfig(_Strict):
    """A generative judge: a model on a rollout engine scoring responses through a prompt."""

    model_path: AbsPath = Field(description="the judge model (a local HF folder)")
    backend: str = Field("transformers", description="a registered rollout engine for the judge")
    template: str | None = Field(
        None,
        description="judge prompt with {prompt}, {response}, {ground_truth} "
        "(None: hf_core.rewards.judge.DEFAULT_TEMPLATE)",
    )
    max_new_tokens: int = Field(8, ge=1, description="tokens the judge may write")
    score_pattern: str = Field(
        r"(-?\d+(?:\.\d+)?)", description="regex; its first group in the output is the score"
    )
    max_score: float = Field(10.0, gt=0, description="the score meaning fully right (-> 1.0)")
    unparsed_score: float = Field(0.0, description="reward of an output with no score")
    engine: dict[str, Any] = Field(default_factory=dict, description="rollout backend settings")


class RewardConfig(_Strict):
    function: str | None = Field(None, description="rule-based reward: name or module:function")
    model: ModelRoleConfig | None = Field(None, description="a reward model instead")
    judge: JudgeConfig | None = Field(
        None, description="a generative judge instead of a reward model (added to function)"
    )
    weight: float = Field(
        1.0,
        ge=0.0,
        description="the reward's weight in the training signal; 0 with a 'teacher': the "
        "reward is logged and validated only (pure distillation, measured on the task)",
    )


class SFTConfig(_Strict):
    """Supervised fine-tuning: ``trainer: sft`` (chat or prompt/completion records, the loss
    on the assistant's tokens), or an optional warm start before RL (``steps``: prompt ->
    ground truth from the RL data)."""

    steps: int = Field(0, ge=0, description="supervised steps (the actor's optimizer)")
    batch_size: int = Field(16, ge=1)
    target_key: str = Field(
        "ground_truth",
        description="dataset field with the target: text, or a multi-turn list of "
        "{text, train} segments (train: false for tool messages, attended but not trained on)",
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="trainer: sft: the most tokens an example may have (longer ones are "
        "dropped and counted); None: no limit",
    )


class PreferenceConfig(_Strict):
    """Training on chosen/rejected pairs: a reward model's Bradley-Terry loss
    (``trainer: reward_model``) and direct preference optimisation (``trainer: dpo``)."""

    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="dpo: sigmoid (DPO) or ipo (IPO's squared loss)"
    )
    beta: float = Field(
        0.1, gt=0, description="dpo: how far from the reference the policy may move"
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo (sigmoid): the share of pairs taken as mislabelled"
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="prompt + response tokens a pair's sequences may have (longer "
        "pairs are dropped and counted); None: no limit",
    )


TRAINERS = ("rl", "sft", "reward_model", "dpo")
"""The dataflows ``hybridflow run`` runs (``trainer:`` in a recipe)."""
TRAINED_ROLE = {"rl": "actor", "sft": "actor", "reward_model": "reward.model", "dpo": "actor"}
"""The recipe section of the model each trainer trains."""


class EnvConfig(BaseModel):
    """A task environment from a library (:mod:`hf_core.environments`): ``kind`` names it;
    the other keys are that kind's settings, validated by it where the recipe loads."""

    model_config = ConfigDict(extra="allow")

    kind: str = Field(description="a registered environment kind (reasoning_gym) or module:Class")


def _env_runs_rollouts(kind: str) -> bool:
    from hf_core.environments.base import kind_runs_rollouts

    return kind_runs_rollouts(kind)


class TrainerConfig(_Strict):
    trainer: Literal["rl", "sft", "reward_model", "dpo"] = Field(
        "rl",
        description="the dataflow: rl (the default), sft (supervised fine-tuning on chat or "
        "prompt/completion data), reward_model (Bradley-Terry on preference pairs, trains "
        "reward.model), dpo (preference pairs against the reference)",
    )
    run: RunConfig = Field(default_factory=RunConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ModelRoleConfig = Field(default_factory=ModelRoleConfig)
    reference: ModelRoleConfig | None = Field(None, description="needed for KL; None: no KL")
    teacher: ModelRoleConfig | None = Field(
        None,
        description="on-policy distillation: a frozen model (its model_path) scoring the "
        "student's samples token by token (algorithm.distill); lives in the actor's worker "
        "like the reference",
    )
    critic: ModelRoleConfig | None = Field(None, description="needed by GAE (PPO)")
    reward: RewardConfig = Field(default_factory=RewardConfig)
    cost: RewardConfig | None = Field(None, description="Safe-RLHF cost: function or model")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    agent: AgentConfig | None = Field(
        None, description="multi-turn tool-using rollouts (None: one response per prompt)"
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="where model-written code runs (the python tool, the code_tests reward)",
    )
    env: EnvConfig | None = Field(
        None,
        description="prompts and rewards from an environment library (replaces data files "
        "and reward.function)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.trainer != "rl":
            if self.env is not None:
                raise ValueError(f"env: trainer: {self.trainer} does not use an environment")
            return self._consistent_post_training()
        reward = self.reward
        if self.env is not None:
            self._consistent_env()
        has_reward = reward.function or reward.model or reward.judge or self.env
        if not has_reward and self.teacher is None and not self.runs_agent_function:
            raise ValueError(
                "reward: give a rule-based 'function', a reward 'model' or a 'judge' (or a "
                "'teacher' to distill from, or an agent.function that returns rewards)"
            )
        if self.reward.weight == 0 and self.teacher is None:
            raise ValueError("reward.weight: 0 leaves nothing to train on without a 'teacher'")
        if self.teacher is not None:
            if self.teacher.model_path is None:
                raise ValueError("teacher.model_path: give the teacher's weights (a HF folder)")
            if self.placement.mode == "auto":
                raise ValueError("teacher: placement.mode=auto does not plan a teacher role")
        if reward.model is not None and reward.judge is not None:
            raise ValueError("reward: a reward 'model' or a 'judge', not both")
        if reward.judge is not None and self.placement.mode == "auto":
            raise ValueError(
                "reward.judge: placement.mode=auto plans model roles; use colocate/split"
            )
        if self.cost is not None and self.cost.judge is not None:
            raise ValueError("cost.judge: a judge scores rewards only; give cost a function/model")
        if self.algorithm.kl.mode != "none" and self.reference is None:
            raise ValueError(f"algorithm.kl.mode={self.algorithm.kl.mode} needs a 'reference'")
        overlong = self.algorithm.overlong
        if overlong.buffer and overlong.buffer >= self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong.buffer={overlong.buffer} must be < "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens}: the penalty ramps over "
                "the last 'buffer' tokens before the limit"
            )
        if self.rollout.max_staleness and self.placement.mode != "standalone":
            raise ValueError(
                f"rollout.max_staleness={self.rollout.max_staleness} needs placement.mode: "
                "standalone (generation can only overlap training on a rollout pool of its own)"
            )
        if self.algorithm.dynamic_sampling.enabled:
            if self.rollout.n < 2:
                raise ValueError(
                    "algorithm.dynamic_sampling needs rollout.n >= 2: it keeps prompt groups "
                    f"whose n rewards differ (rollout.n={self.rollout.n})"
                )
            if self.rollout.mode == "batch" and self.rollout.max_staleness:
                raise ValueError(
                    "algorithm.dynamic_sampling with rollout.max_staleness > 0 needs "
                    "rollout.mode: streaming (extra prompts are drawn from the stream; batch "
                    "mode has whole batches queued ahead)"
                )
        if self.rollout.mode == "streaming" and self.placement.mode != "standalone":
            raise ValueError(
                "rollout.mode: streaming needs placement.mode: standalone (the pool generates "
                "while the actor trains)"
            )
        pools = [self.placement.processes]
        if self.placement.mode == "standalone":
            pools.append(self.placement.rollout_processes)
        if self.placement.mode == "split":
            pools.append(self.placement.other_processes)
        if self.placement.mode != "auto" and any(n % self.placement.nodes for n in pools):
            raise ValueError(
                f"placement.nodes={self.placement.nodes} must divide every pool's processes "
                f"({pools}): each node gets the same number of ranks"
            )
        ranks = {self.placement.processes}
        if self.placement.mode == "split":
            ranks.add(self.placement.other_processes)
        if self.placement.mode == "auto":
            ranks = set()  # checked against the planner's pools (trainer.auto_placement)
        samples = self.data.batch_size * self.rollout.n
        for count in sorted(ranks):
            per_update = count * self.algorithm.mini_batches
            if samples % per_update:
                raise ValueError(
                    f"data.batch_size * rollout.n = {samples} samples must split evenly into "
                    f"{count} ranks * algorithm.mini_batches = {per_update} parts"
                )
        return self

    def _consistent_post_training(self) -> TrainerConfig:
        """The roles and batch sizes of the supervised and preference trainers: a missing
        role is named with the key to add, before anything starts."""
        if self.placement.mode != "colocate":
            raise ValueError(
                f"trainer: {self.trainer} trains one model on one pool: placement.mode "
                f"colocate, not {self.placement.mode!r} (which places rollouts or roles apart)"
            )
        if self.trainer == "reward_model" and self.reward.model is None:
            raise ValueError(
                "trainer: reward_model trains reward.model: add a 'reward.model' section (its "
                "model_path defaults to model.path, the backbone the score head starts from)"
            )
        if self.trainer == "dpo" and self.reference is None:
            raise ValueError(
                "trainer: dpo needs a 'reference' section: the frozen policy the pairs' "
                "log-probs are measured against (usually model.path, the SFT model)"
            )
        rows = self.data.batch_size * (1 if self.trainer == "sft" else 2)
        if rows % self.placement.processes:
            what = "examples" if self.trainer == "sft" else "rows (2 per pair)"
            raise ValueError(
                f"data.batch_size gives {rows} {what} per step, which must split evenly "
                f"over placement.processes={self.placement.processes} ranks"
            )
        return self

    def _consistent_env(self) -> None:
        """An environment gives the prompts and the reward: files or a reward function of
        the recipe's own would be silently ignored, so they are refused."""
        given = [
            key
            for key, value in (
                ("data.train_files", self.data.train_files),
                ("data.val_files", self.data.val_files),
                ("reward.function", self.reward.function),
            )
            if value
        ]
        if given:
            raise ValueError(
                f"env: the environment gives the prompts and the reward; remove {given}"
            )
        kind = self.env.kind if self.env is not None else ""
        if _env_runs_rollouts(kind):  # its episodes run against the policy endpoint
            if self.agent is None:
                self.agent = AgentConfig()  # the turn, token and time limits of an episode
            elif self.agent.function is not None:
                raise ValueError(
                    f"agent.function: env.kind {kind} runs each sample's episode "
                    "itself; remove agent.function"
                )

    @property
    def runs_agent_function(self) -> bool:
        """Whether each sample is an agent run against the policy endpoint: the recipe's
        ``agent.function``, or an environment that runs its own episodes (verifiers,
        OpenEnv); the run's reward is then what each run returns."""
        if self.agent is None:
            return False
        return self.agent.function is not None or (
            self.env is not None and self.trainer == "rl" and _env_runs_rollouts(self.env.kind)
        )

    def role_model(self, role: ModelRoleConfig) -> Path:
        return role.model_path or self.model.path

    @property
    def tokenizer_path(self) -> Path:
        return self.model.tokenizer_path or self.model.path
