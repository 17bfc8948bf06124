"""Asynchronous RL pieces without Ray: the staleness schedule, the weight channel, the
truncated importance weights and the recipe checks."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.roles.losses import (
    PolicyLoss,
    rollout_is_cap,
    rollout_is_mode,
    rollout_is_weights,
)
from hf_core.roles.rollout_pool import ROLLOUT_VERSION
from hf_core.sync import WeightChannel
from hf_core.trainer.rollout_source import StandaloneRollouts


def _config(tmp_path: Path, **sections: Any) -> TrainerConfig:
    doc: dict[str, Any] = {
        "model": {"path": str(tmp_path)},
        "reward": {"function": "digits_reverse"},
        "placement": {"mode": "standalone"},
        "run": {"total_steps": 8},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return TrainerConfig.model_validate(doc)


# ------------------------------------------------------------------ fakes


class FakeFuture:
    def __init__(self, value: Any, done: bool = True) -> None:
        self.value, self.finished = value, done

    def done(self) -> bool:
        return self.finished

    def result(self) -> Any:
        self.finished = True
        return self.value


class Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args).result()


@dataclass
class FakeCluster:
    """The actor group and rollout pool as the schedule sees them, with a call log.

    Like the real pool, every batch says which weights generated it (``ROLLOUT_VERSION``):
    the actor's update count at the last broadcast, known apart from the schedule's books."""

    generation_done: bool = True
    log: list[tuple[str, int]] = field(default_factory=list)
    rollout_version: int = 0
    actor_version: int = 0
    world_size: int = 1
    pool_dtype: torch.dtype | None = torch.bfloat16
    followed: list[torch.dtype | None] = field(default_factory=list)
    """The dtypes the actor was told the pool generates in."""

    def __post_init__(self) -> None:
        self.compute_dtype = Method(lambda: FakeFuture(self.pool_dtype))
        self.follow_rollout_dtype = Method(lambda d: FakeFuture(self.followed.append(d)))
        self.node_key = Method(lambda: FakeFuture(["node"] * self.world_size))
        self.open_weight_channel = Method(lambda nodes: FakeFuture(f"address for {nodes}"))
        self.join_weight_channel = Method(lambda *a: FakeFuture(None))
        self.sync_weights = Method(self._send)
        self.receive_weights = Method(lambda: FakeFuture([{"reshard/bytes_received": 8.0}]))
        self.generate = Method(self._generate)

    def _send(self) -> FakeFuture:
        self.rollout_version = self.actor_version
        self.log.append(("sync", self.actor_version))
        return FakeFuture([{"reshard/model_bytes": 8.0}])

    def _generate(self, prompts: Batch, params: Any) -> FakeFuture:
        self.log.append(("generate", int(prompts["input_ids"][0, 0])))
        out = Batch({ROLLOUT_VERSION: torch.tensor([self.rollout_version])})
        return FakeFuture(out, self.generation_done)


class FakeLoader:
    def __init__(self) -> None:
        self.drawn = 0

    def __next__(self) -> Batch:
        self.drawn += 1
        ids = torch.tensor([[self.drawn]])
        return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.drawn = state["drawn"]


@dataclass
class FakeGroups:
    actor: FakeCluster
    rollout: FakeCluster


def _events(spec: str) -> list[tuple[str, int]]:
    """``"g1 s1"`` -> ``[("generate", 1), ("sync", 1)]``: generations by step, syncs by the
    version sent."""
    kinds = {"g": "generate", "s": "sync"}
    return [(kinds[item[0]], int(item[1:])) for item in spec.split()]


def _run(tmp_path: Path, k: int, steps: int, generation_done: bool = True):
    cluster = FakeCluster(generation_done=generation_done)
    loader = FakeLoader()
    config = _config(tmp_path, rollout={"max_staleness": k}, run={"total_steps": steps})
    source = StandaloneRollouts(config, FakeGroups(cluster, cluster), loader)  # type: ignore[arg-type]
    staleness, versions = [], []
    for step in range(1, steps + 1):
        samples = source.take(step)
        assert int(samples.prompts["input_ids"][0, 0]) == step  # prompts in order
        metrics = source.take_metrics()
        staleness.append(metrics["async/staleness"])
        histogram = [metrics[f"async/samples_at_staleness_{age}"] for age in range(k + 1)]
        assert histogram == [staleness.count(age) for age in range(k + 1)]  # 1 sample a batch
        versions.append(samples.version)
        # the schedule's tag is what the pool really generated with
        assert samples.generated[ROLLOUT_VERSION].tolist() == [samples.version]
        assert metrics["async/rollout_version"] == metrics["async/policy_version"]
        cluster.actor_version = step  # the update
        source.after_update(step)
    return cluster.log, staleness, versions, source


# ------------------------------------------------------------------ schedule


def test_staleness_zero_is_generate_train_sync(tmp_path: Path) -> None:
    log, staleness, versions, _ = _run(tmp_path, k=0, steps=3)
    assert log == _events("g1 s1 g2 s2 g3 s3")
    assert staleness == [0, 0, 0] and versions == [0, 1, 2]


def test_the_actor_is_told_the_dtype_the_pool_generates_in(tmp_path: Path) -> None:
    """Once, before the weight channel forms: its rollout correction follows the pool's
    resolved dtype (``rollout.engine.dtype: auto`` names none in the settings)."""
    *_, source = _run(tmp_path, k=1, steps=2)
    assert source.groups.actor.followed == [torch.bfloat16]


def test_one_step_ahead_generates_the_next_batch_before_training(tmp_path: Path) -> None:
    log, staleness, versions, _ = _run(tmp_path, k=1, steps=4)
    # step 1 queues batch 2 on the initial weights; every later step syncs, then queues the
    # next batch, then trains: the pool works while the actor trains.  After the last update
    # nothing is in flight: those weights go out at once.
    assert log == _events("g1 g2 s1 g3 s2 g4 s4")
    assert staleness == [0, 1, 1, 1] and versions == [0, 0, 1, 2]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("generation_done", [True, False])
def test_no_batch_is_older_than_max_staleness(
    tmp_path: Path, k: int, generation_done: bool
) -> None:
    log, staleness, _, source = _run(tmp_path, k=k, steps=10, generation_done=generation_done)
    assert max(staleness) <= k
    assert source.dropped_samples == 0
    assert [step for kind, step in log if kind == "generate"] == list(range(1, 11))


def test_a_pending_generation_defers_the_sync(tmp_path: Path) -> None:
    """With another batch still generating, a sync would make the actor wait for it: the
    sync waits until that batch is the one needed (within the bound)."""
    log, staleness, _, _ = _run(tmp_path, k=2, steps=4, generation_done=False)
    # At step 2, batch 4 needs weights 1: deferred behind batch 3, sent at step 3 instead.
    assert log == _events("g1 g2 g3 s2 g4 s4")
    assert staleness == [0, 1, 2, 1]
    finished, finished_staleness, _, _ = _run(tmp_path, k=2, steps=4, generation_done=True)
    assert finished[3] == ("sync", 1)  # batch 3 already done: the sync costs no wait
    assert finished_staleness == [0, 1, 2, 2]


def test_a_batch_over_the_bound_is_dropped_counted_and_regenerated(tmp_path: Path) -> None:
    """Lowering the bound under batches in flight (a schedule change) leaves batch 3 two
    versions old at step 3: it is dropped, counted, and its prompts generated again with the
    current weights -- as the pool itself reports."""
    cluster, loader = FakeCluster(), FakeLoader()
    config = _config(tmp_path, rollout={"max_staleness": 2})
    source = StandaloneRollouts(config, FakeGroups(cluster, cluster), loader)  # type: ignore[arg-type]
    for step in (1, 2):
        source.take(step)
        cluster.actor_version = step
        source.after_update(step)
    assert cluster.log == _events("g1 g2 g3 s1 g4")  # batch 3 generated with version 0
    source.take_metrics()
    source.max_staleness = 0
    samples = source.take(3)
    metrics = source.take_metrics()
    assert cluster.log[5:] == _events("s2 g3")  # fresh weights, then batch 3's prompts again
    assert int(samples.prompts["input_ids"][0, 0]) == 3
    assert samples.version == 2 and samples.generated[ROLLOUT_VERSION].tolist() == [2]
    assert source.dropped_samples == 1 and metrics["async/dropped_samples"] == 1
    assert metrics["async/staleness"] == 0 and metrics["async/rollout_version"] == 2
    assert metrics["async/samples_at_staleness_0"] == 2  # steps 1 and 3; the dropped not
    cluster.actor_version = 3
    source.after_update(3)
    assert int(source.take(4).prompts["input_ids"][0, 0]) == 4  # batch 4 (cleared) drawn again


def test_a_checkpoint_keeps_the_loader_before_batches_in_flight(tmp_path: Path) -> None:
    cluster, loader = FakeCluster(), FakeLoader()
    config = _config(tmp_path, rollout={"max_staleness": 1})
    source = StandaloneRollouts(config, FakeGroups(cluster, cluster), loader)  # type: ignore[arg-type]
    source.take(1)  # draws prompts 1 and 2 (2 is in flight)
    assert loader.drawn == 2
    assert source.loader_state() == {"drawn": 1}  # a resumed run draws batch 2 again


# ------------------------------------------------------------------ IS weights


def test_importance_weights_are_truncated_and_masked() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, metrics = rollout_is_weights(old, rollout, mask, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.0]]))
    assert metrics["is_weight_max"] == pytest.approx(5.0)
    assert metrics["is_clip_frac"] == pytest.approx(0.5)
    assert metrics["is_weight_mean"] == pytest.approx(1.5)


def test_weighted_policy_loss_scales_each_tokens_gradient(tmp_path: Path) -> None:
    config = _config(tmp_path, rollout={"max_staleness": 1})
    cap = rollout_is_cap(config)
    assert cap == 2.0
    log_probs = torch.log(torch.tensor([[0.4, 0.6]])).requires_grad_()
    rollout = torch.log(torch.tensor([[0.4, 0.2]]))  # token 2: weight 3 -> capped at 2
    mb = Batch(
        {
            "response_mask": torch.ones(1, 2),
            "advantages": torch.ones(1, 2),
            "rollout_log_probs": rollout,
        }
    )
    mb.meta.update(dp_size=1, global_response_tokens=2, global_batch_size=1)
    loss, metrics = PolicyLoss(config.algorithm, is_cap=cap)({"log_probs": log_probs}, mb)
    loss.backward()
    assert log_probs.grad is not None
    # On-policy ratio 1: d(-A w r)/d logp = -w / tokens
    assert torch.allclose(log_probs.grad, torch.tensor([[-0.5, -1.0]]))
    assert metrics["is_clip_frac"] == 0.5


def test_importance_weights_follow_rollout_is(tmp_path: Path) -> None:
    assert rollout_is_cap(_config(tmp_path)) is None  # auto, synchronous
    assert rollout_is_cap(_config(tmp_path, algorithm={"rollout_is": "truncated"})) == 2.0
    off = _config(tmp_path, rollout={"max_staleness": 1}, algorithm={"rollout_is": "none"})
    assert rollout_is_cap(off) is None


@pytest.mark.parametrize(
    ("sections", "mode"),
    [
        ({"actor": {"engine": {"param_dtype": "bfloat16"}}}, "truncated"),
        ({"rollout": {"engine": {"dtype": "bfloat16"}}}, "truncated"),
        ({"actor": {"engine": {"mixed_precision": "float16"}}}, "truncated"),
        ({"actor": {"engine": {"param_dtype": "float32"}}}, None),
        ({"actor": {"engine": {"param_dtype": "bfloat16"}}, "algorithm": {"rollout_is": "none"}},
         None),
        ({"algorithm": {"rollout_is": "masked"}}, "masked"),
    ],
)  # fmt: skip
def test_auto_correction_turns_on_in_half_precision(
    tmp_path: Path, sections: dict, mode: str | None
) -> None:
    """Synchronous runs too: bf16 engines disagree by rounding, not only summation order."""
    assert rollout_is_mode(_config(tmp_path, **sections)) == mode


@pytest.mark.parametrize(
    ("rollout_dtype", "mode"),
    [(torch.bfloat16, "truncated"), (torch.float32, None), (None, None)],
)
def test_auto_correction_follows_the_rollout_engines_resolved_dtype(
    tmp_path: Path, rollout_dtype: torch.dtype | None, mode: str | None
) -> None:
    """A rollout engine's ``dtype: auto`` names no 16-bit type in the settings; the dtype it
    resolved to on its device decides."""
    config = _config(tmp_path)
    assert rollout_is_mode(config, torch.float32, rollout_dtype) == mode
    assert (rollout_is_cap(config, torch.float32, rollout_dtype) is None) == (mode is None)


def test_masked_correction_drops_tokens_outside_the_band() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.1, 0.9]]))
    rollout = torch.log(torch.tensor([[0.4, 0.1, 0.5, 0.3]]))  # ratios 1.25, 5, 0.2, (3)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, metrics = rollout_is_weights(old, rollout, mask, cap=2.0, mode="masked")
    assert torch.equal(weights, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert metrics["is_masked_frac"] == pytest.approx(2 / 3)
    truncated, _ = rollout_is_weights(old, rollout, mask, cap=2.0)
    assert torch.allclose(truncated, torch.tensor([[1.25, 2.0, 0.2, 0.0]]))


# ------------------------------------------------------------------ recipe checks


def test_staleness_needs_a_rollout_pool(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"placement\.mode: standalone"):
        _config(tmp_path, placement={"mode": "colocate"}, rollout={"max_staleness": 1})


def test_streaming_needs_a_rollout_pool(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"streaming needs placement\.mode: standalone"):
        _config(tmp_path, placement={"mode": "colocate"}, rollout={"mode": "streaming"})
    assert _config(tmp_path, rollout={"mode": "streaming"}).rollout.partial_rollouts


def test_a_standalone_pool_runs_whole_model_engines(tmp_path: Path) -> None:
    from hf_core.config import ConfigError
    from hf_core.trainer.preflight import preflight

    with pytest.raises(ConfigError, match=r"whole-model rollout engine .*tensor_parallel_size"):
        preflight(_config(tmp_path, rollout={"tensor_parallel_size": 2, "n": 2}))


# ------------------------------------------------------------------ weight channel


def _receiver(address: Any, rank: int, queue: Any) -> None:
    channel = WeightChannel.connect(address, rank, torch.device("cpu"), 60.0)
    messages = []
    while (message := channel.take()).numel():
        # bytes, not tensors: a tensor crosses a torch queue as a file descriptor that the
        # parent fetches from this process, which may have exited by then
        messages.append(message.numpy().tobytes())
    doubt = channel.agree(rank == 2)
    queue.put((rank, messages, doubt))


@pytest.mark.parametrize("nodes", [("a", "a", "a"), ("a", "b", "b")])
def test_the_channel_relays_every_message_to_every_receiver(nodes: tuple[str, ...]) -> None:
    """One node of three (a leader relays to two) and two nodes (one leader alone): every
    receiver gets every message in order, and a doubt raised by one reaches all."""
    store, address = WeightChannel.listen("127.0.0.1", nodes, 60.0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = range(1, len(nodes) + 1)
    receivers = [ctx.Process(target=_receiver, args=(address, r, queue)) for r in ranks]
    for process in receivers:
        process.start()
    sender = WeightChannel(store, 0, nodes, torch.device("cpu"), 60.0)
    sent = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (5, 1 << 16, 3)]
    for message in sent:
        sender.post(message)
    sender.post(None)
    assert sender.agree(False) is True  # rank 2 doubted
    got = [queue.get(timeout=60) for _ in receivers]
    for process in receivers:
        process.join(timeout=60)
    assert sorted(rank for rank, _, _ in got) == list(ranks)
    for _, messages, doubt in got:
        assert doubt is True
        assert len(messages) == len(sent)
        assert messages == [message.numpy().tobytes() for message in sent]


def test_auto_correction_follows_the_actors_compute_dtype(tmp_path: Path) -> None:
    """Settings may name no dtype while the actor computes in bf16 (FSDP's ``mixed_precision:
    auto`` on a GPU): the engine's ``compute_dtype`` turns the correction on."""
    config = _config(tmp_path, placement={"mode": "colocate"})
    assert rollout_is_mode(config) is None
    assert rollout_is_mode(config, torch.bfloat16) == "truncated"
    assert rollout_is_cap(config, torch.float16) == 2.0
    off = _config(tmp_path, placement={"mode": "colocate"}, algorithm={"rollout_is": "none"})
    assert rollout_is_mode(off, torch.bfloat16) is None
