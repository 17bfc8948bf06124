"""The role losses give one update however a mini-batch is split into micro-batches and ranks.

Engines sum micro-batch gradients and average them over data-parallel ranks, each micro-batch
scaled with the counts :func:`hf_core.engines.loss_totals.loss_totals` puts in its meta.  Here
ranks are simulated (threads meeting in an all-reduce), micro-batches are trimmed as the
engines trim them, and the mini-batch has rows masked out whole (what overlong filtering
produces), one group without any token and groups scattered over micro-batches (the PPO loop
shuffles rows before splitting).  Every split must give the loss and the gradient of one step
on the whole mini-batch, for every aggregation mode.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hf_core.algorithms import get_policy_loss
from hf_core.algorithms.losses import PolicyLossConfig
from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig
from hf_core.config.schema import KLConfig
from hf_core.engines.loss_totals import ReduceOp, all_reduce_over, loss_totals
from hf_core.engines.micro_batches import trim_padding
from hf_core.roles.losses import PolicyLoss, ValueLoss, loss_agg_mode_advice

D = torch.float64
MODES = [
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "group-mean-token-mean",
]
PROMPT, WIDTH = 2, 6
# response lengths, group by group: group 1 has no token at all, group 0 an empty row
LENGTHS = [3, 0, 0, 0, 5, 1]
GROUPS = [0, 0, 1, 1, 2, 2]
ORDERS = [list(range(6)), [4, 1, 5, 2, 0, 3]]  # as given; shuffled as the PPO loop does


def _mini_batch(order: list[int]) -> tuple[Batch, torch.Tensor]:
    """The mini-batch (rows in ``order``) and the 'model': one log-prob parameter per token."""
    gen = torch.Generator().manual_seed(57)
    rows = len(LENGTHS)
    mask = torch.tensor([[1] * n + [0] * (WIDTH - n) for n in LENGTHS])
    attention = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), mask], dim=1)
    theta = -1.0 + 0.3 * torch.randn(rows, WIDTH, generator=gen, dtype=D)
    old = theta + 0.3 * torch.randn(rows, WIDTH, generator=gen, dtype=D)  # ratios clip
    batch = Batch(
        {
            "input_ids": torch.arange(rows * (PROMPT + WIDTH)).reshape(rows, -1) * attention,
            "attention_mask": attention,
            "responses": torch.arange(rows * WIDTH).reshape(rows, WIDTH) * mask,
            "response_mask": mask,
            "advantages": torch.randn(rows, 1, generator=gen, dtype=D).expand(rows, WIDTH) * mask,
            "old_log_probs": old,
            "rollout_log_probs": old + 0.2 * torch.randn(rows, WIDTH, generator=gen, dtype=D),
            "ref_log_probs": old + 0.5 * torch.randn(rows, WIDTH, generator=gen, dtype=D),
            "old_values": torch.randn(rows, WIDTH, generator=gen, dtype=D),
            "returns": torch.randn(rows, WIDTH, generator=gen, dtype=D),
            "group_index": torch.tensor(GROUPS),
        }
    )
    index = torch.tensor(order)
    return batch.index(index), theta[index].clone().requires_grad_()


def _compositions(rows: list[int]) -> Iterator[list[list[int]]]:
    """Every split of ``rows`` into consecutive non-empty micro-batches."""
    for cuts in itertools.product([False, True], repeat=max(0, len(rows) - 1)):
        parts, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                parts.append(rows[start:i])
                start = i
        yield [*parts, rows[start:]]


def _splits(rows: int) -> Iterator[list[list[list[int]]]]:
    """Every (ranks -> micro-batches -> rows) split on 1 rank and on 2 ranks."""
    everything = list(range(rows))
    for micro in _compositions(everything):
        yield [micro]
    for boundary in range(1, rows):
        first, second = everything[:boundary], everything[boundary:]
        for a, b in itertools.product(_compositions(first), _compositions(second)):
            yield [a, b]


class _Ranks:
    """Threads standing in for data-parallel ranks: an all-reduce over their tensors."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def reduce_on(self, rank: int) -> Any:
        def reduce(counts: torch.Tensor, op: ReduceOp) -> torch.Tensor:
            self.slots[rank] = counts.clone()
            self.barrier.wait()
            stacked = torch.stack([s for s in self.slots if s is not None])
            out = stacked.sum(dim=0) if op == "sum" else stacked.amax(dim=0)
            self.barrier.wait()  # every rank has read the slots before they are reused
            return out

        return reduce


def _rank_metas(parts: list[Batch]) -> list[dict[str, Any]]:
    """What each rank's engine puts in its micro-batches' meta (core's helper, all-reduced)."""
    ranks = _Ranks(len(parts))
    with ThreadPoolExecutor(len(parts)) as pool:
        totals = list(
            pool.map(lambda r: loss_totals([parts[r]], ranks.reduce_on(r)), range(len(parts)))
        )
    return [{**t, "dp_size": len(parts), "dp_rank": r} for r, t in enumerate(totals)]


def _outputs(theta: torch.Tensor, rows: list[int], width: int) -> dict[str, torch.Tensor]:
    log_probs = theta[rows][:, :width]
    return {
        "log_probs": log_probs,
        "entropy": torch.nn.functional.softplus(log_probs),
        "values": 0.5 * log_probs,
    }


_METAS: dict[tuple[tuple[int, ...], ...], list[dict[str, Any]]] = {}


def _update(
    loss_fn: Any, batch: Batch, theta: torch.Tensor, split: list[list[list[int]]]
) -> tuple[float, torch.Tensor]:
    """The loss and gradient the engines produce: micro-batch gradients summed on each rank,
    then averaged over the ranks (the logged loss: summed per rank, averaged over ranks)."""
    ranks = tuple(tuple(itertools.chain.from_iterable(micro)) for micro in split)
    if ranks not in _METAS:  # the meta depends on the ranks' rows only
        _METAS.clear()
        _METAS[ranks] = _rank_metas([batch.index(torch.tensor(rows)) for rows in ranks])
    metas = _METAS[ranks]
    losses, grads = [], []
    for rank_rows, meta in zip(split, metas, strict=True):
        total = torch.zeros((), dtype=D)
        for rows in rank_rows:
            mb = trim_padding(batch.index(torch.tensor(rows)))
            mb.meta.update(meta, micro_batch_size=len(mb))
            loss, _ = loss_fn(_outputs(theta, rows, mb["response_mask"].shape[1]), mb)
            total = total + loss
        (grad,) = torch.autograd.grad(total, theta, allow_unused=True)
        losses.append(float(total.detach()))
        grads.append(torch.zeros_like(theta) if grad is None else grad)
    return sum(losses) / len(losses), torch.stack(grads).mean(dim=0)


def _algo(mode: str, policy_loss: str) -> AlgorithmConfig:
    return AlgorithmConfig(
        policy_loss=policy_loss,
        loss_agg_mode=mode,
        entropy_coef=0.01,
        kl=KLConfig(mode="in_loss", coef=0.1),
    )


@pytest.mark.parametrize(("policy_loss", "order"), [("ppo_clip", 0), ("ppo_clip", 1), ("gspo", 1)])
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_update_is_the_same_for_every_split(
    mode: str, policy_loss: str, order: int
) -> None:
    batch, theta = _mini_batch(ORDERS[order])
    loss_fn = PolicyLoss(_algo(mode, policy_loss), is_cap=2.0)
    everything = list(range(len(batch)))
    loss, grad = _update(loss_fn, batch, theta, [[everything]])
    assert grad.abs().max() > 1e-3  # the update moves something
    checked = 0
    for split in _splits(len(batch)):
        split_loss, split_grad = _update(loss_fn, batch, theta, split)
        assert split_loss == pytest.approx(loss, abs=1e-6), split
        torch.testing.assert_close(split_grad, grad, atol=1e-6, rtol=0, msg=str(split))
        checked += 1
    assert checked == 2 ** (len(batch) - 1) + (len(batch) - 1) * 2 ** (len(batch) - 2)


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_update_is_the_same_for_every_split(mode: str) -> None:
    batch, theta = _mini_batch(ORDERS[1])
    loss_fn = ValueLoss(AlgorithmConfig(loss_agg_mode=mode))
    loss, grad = _update(loss_fn, batch, theta, [[list(range(len(batch)))]])
    assert grad.abs().max() > 1e-3
    for split in itertools.islice(_splits(len(batch)), 0, None, 7):
        split_loss, split_grad = _update(loss_fn, batch, theta, split)
        assert split_loss == pytest.approx(loss, abs=1e-6), split
        torch.testing.assert_close(split_grad, grad, atol=1e-6, rtol=0, msg=str(split))


@pytest.mark.parametrize("mode", MODES)
def test_one_micro_batch_on_one_rank_is_the_plain_aggregation(mode: str) -> None:
    """The reference above is the algorithm's own loss on the whole mini-batch: the scaling
    neither drops nor double-counts anything (empty rows and the empty group included)."""
    batch, theta = _mini_batch(ORDERS[1])
    loss_fn = PolicyLoss(AlgorithmConfig(loss_agg_mode=mode))
    loss, _ = _update(loss_fn, batch, theta, [[list(range(len(batch)))]])
    plain, _ = get_policy_loss("ppo_clip")(
        theta,
        batch["old_log_probs"],
        batch["advantages"],
        batch["response_mask"],
        PolicyLossConfig(loss_agg_mode=mode, norm_length=WIDTH),
        index=batch["group_index"],
    )
    assert loss == pytest.approx(float(plain.detach()), abs=1e-12)


def test_loss_totals_count_the_whole_mini_batch() -> None:
    batch, _ = _mini_batch(ORDERS[1])
    halves = [batch.index(torch.arange(0, 3)), batch.index(torch.arange(3, len(batch)))]
    expected = {
        "global_batch_size": len(LENGTHS),
        "global_response_tokens": sum(LENGTHS),
        "global_nonempty_rows": sum(1 for n in LENGTHS if n),
        "global_response_length": WIDTH,
        "global_group_tokens": [
            sum(n for n, g in zip(LENGTHS, GROUPS, strict=True) if g == group)
            for group in range(max(GROUPS) + 1)
        ],
    }
    assert loss_totals([batch]) == expected
    assert loss_totals(halves) == expected
    assert all(meta.items() >= expected.items() for meta in _rank_metas(halves))
    trimmed = trim_padding(halves[0])  # a narrower rank: the width is the widest rank's
    assert loss_totals([trimmed, halves[1]])["global_response_length"] == WIDTH
    no_groups = batch.select(*(k for k in batch.keys() if k != "group_index"))
    assert "global_group_tokens" not in loss_totals([no_groups])


def test_all_reduce_over_a_process_group(tmp_path: Any) -> None:
    """The torch.distributed form the engines use (one rank: sums and maxima are the input;
    ``copies`` divides the sums only)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        counts = torch.tensor([4, 6, 2], dtype=torch.int64)
        assert all_reduce_over("cpu")(counts, "sum").tolist() == [4, 6, 2]
        assert all_reduce_over("cpu", copies=2)(counts, "sum").tolist() == [2, 3, 1]
        assert all_reduce_over("cpu", copies=2)(counts, "max").tolist() == [4, 6, 2]
        batch, _ = _mini_batch(ORDERS[0])
        assert loss_totals([batch], all_reduce_over("cpu")) == loss_totals([batch])
    finally:
        dist.destroy_process_group()


def _one_micro_batch(mode: str, drop: str | None = None) -> tuple[dict[str, Any], Batch]:
    batch, theta = _mini_batch(ORDERS[0])
    meta = _rank_metas([batch])[0]
    if drop in meta:
        del meta[drop]
    if drop == "group_index":
        batch = batch.select(*(k for k in batch.keys() if k != "group_index"))
    batch.meta.update(meta)
    return _outputs(theta, list(range(len(batch))), WIDTH), batch


@pytest.mark.parametrize(
    ("mode", "missing"),
    [
        ("seq-mean-token-mean", "global_nonempty_rows"),
        ("seq-mean-token-sum-norm", "global_response_length"),
        ("group-mean-token-mean", "global_group_tokens"),
        ("group-mean-token-mean", "group_index"),
        ("token-mean", "dp_size"),
    ],
)
def test_a_missing_count_is_named(mode: str, missing: str) -> None:
    outputs, mb = _one_micro_batch(mode, drop=missing)
    with pytest.raises(KeyError, match=missing):
        PolicyLoss(AlgorithmConfig(loss_agg_mode=mode))(outputs, mb)


def test_group_totals_that_miss_tokens_are_refused() -> None:
    """An engine passing this rank's counts as the global ones would scale silently wrong."""
    outputs, mb = _one_micro_batch("group-mean-token-mean")
    mb.meta["global_group_tokens"] = [n // 2 for n in mb.meta["global_group_tokens"]]
    with pytest.raises(ValueError, match="global_group_tokens"):
        PolicyLoss(AlgorithmConfig(loss_agg_mode="group-mean-token-mean"))(outputs, mb)


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo_token"])
def test_gspo_with_another_aggregation_warns(
    policy_loss: str, caplog: pytest.LogCaptureFixture
) -> None:
    paired = AlgorithmConfig(policy_loss=policy_loss, loss_agg_mode="seq-mean-token-mean")
    other = AlgorithmConfig(policy_loss=policy_loss, loss_agg_mode="token-mean")
    assert loss_agg_mode_advice(paired) is None
    assert loss_agg_mode_advice(AlgorithmConfig(loss_agg_mode="token-mean")) is None
    with caplog.at_level(logging.WARNING, logger="hf_core.roles.losses"):
        PolicyLoss(paired)
        assert not caplog.records
        PolicyLoss(other)
    (record,) = caplog.records
    assert "seq-mean-token-mean" in record.getMessage()
    assert f"policy_loss={policy_loss}" in record.getMessage()
