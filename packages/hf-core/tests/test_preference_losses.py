"""Pairwise preference losses (Bradley-Terry, DPO sigmoid / IPO) and their engine surrogate.

The losses are checked against references written another way (softplus or an explicit
log σ, the margin grouped differently, derivatives by hand), values and gradients.  The
surrogate is checked the way an engine runs it: pairs torn across micro-batches and across
two data-parallel ranks must still give the exact gradient of the mean pair loss, and a
naive per-micro-batch loss, which cannot see a row's partner, must not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from float64 import D

from hf_core.algorithms import (
    DPO_LOSS_TYPES,
    PREFERENCE_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    dpo_metrics,
    pair_metrics,
)
from hf_core.batch import Batch
from hf_core.roles.preference_losses import (
    PAIR_WEIGHT_KEY,
    LinearisedPairLoss,
    dpo_pair_loss,
    pair_row_weights,
    sequence_log_probs,
)

Split = list[list[list[int]]]
"""ranks -> micro-batches -> row indices."""
LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, float]]]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen, dtype=D)


# ------------------------------------------------------------------ independent references
def ref_bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """−log σ(x) = softplus(−x) = log(1 + e^(−x))."""
    return F.softplus(rejected + margin - chosen)


def ref_bradley_terry_explicit(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """The textbook form, fine for moderate gaps in float64."""
    return -torch.log(1.0 / (1.0 + torch.exp(-(chosen - rejected - margin))))


def ref_h(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor) -> torch.Tensor:
    """The DPO margin grouped as policy log-ratio minus reference log-ratio."""
    return (pc - pr) - (rc - rr)


def ref_dpo_sigmoid(
    pc: torch.Tensor,
    pr: torch.Tensor,
    rc: torch.Tensor,
    rr: torch.Tensor,
    beta: float,
    ls: float,
) -> torch.Tensor:
    """The label is right with probability 1 − ls: cross-entropy against (1 − ls, ls)."""
    p_chosen = torch.sigmoid(beta * ref_h(pc, pr, rc, rr))
    return -(1.0 - ls) * torch.log(p_chosen) - ls * torch.log(1.0 - p_chosen)


def ref_ipo(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float
) -> torch.Tensor:
    target = 1.0 / (2.0 * beta)
    diff = ref_h(pc, pr, rc, rr) - target
    return diff * diff


def ref_dpo_dl_dh(h: torch.Tensor, beta: float, loss_type: str, ls: float) -> torch.Tensor:
    """d l / d h by hand: σ'(z) = σ(z)σ(−z), so d/dh −log σ(βh) = −β σ(−βh)."""
    if loss_type == "ipo":
        return 2.0 * (h - 1.0 / (2.0 * beta))
    return -beta * (1.0 - ls) * torch.sigmoid(-beta * h) + beta * ls * torch.sigmoid(beta * h)


def _values_and_grads(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], cotangent: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """fn's per-pair values and the gradient of Σ cotangent·values w.r.t. every input."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    values = fn(*leaves)
    grads = torch.autograd.grad((values * cotangent).sum(), leaves)
    return values.detach(), grads


def _assert_same(
    ours: tuple[torch.Tensor, tuple[torch.Tensor, ...]],
    theirs: tuple[torch.Tensor, tuple[torch.Tensor, ...]],
) -> None:
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-12, rtol=1e-10)
    for a, b in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------------ the losses
@pytest.mark.parametrize("margin", ["none", "float", "per_pair"])
def test_bradley_terry_equals_the_softplus_reference(margin: str) -> None:
    gen = torch.Generator().manual_seed(1)
    chosen, rejected, m = _randn(gen, 64, scale=3), _randn(gen, 64, scale=3), _randn(gen, 64)
    cot = _randn(gen, 64)
    if margin == "per_pair":
        ours = _values_and_grads(bradley_terry_loss, (chosen, rejected, m), cot)
        theirs = _values_and_grads(ref_bradley_terry, (chosen, rejected, m), cot)
        explicit = ref_bradley_terry_explicit(chosen, rejected, m)
    else:
        value = 0.7 if margin == "float" else None
        ours = _values_and_grads(
            lambda c, r: bradley_terry_loss(c, r, value), (chosen, rejected), cot
        )
        theirs = _values_and_grads(
            lambda c, r: ref_bradley_terry(c, r, value or 0.0), (chosen, rejected), cot
        )
        explicit = ref_bradley_terry_explicit(chosen, rejected, value or 0.0)
    _assert_same(ours, theirs)
    torch.testing.assert_close(ours[0], explicit, atol=1e-12, rtol=1e-10)


def test_bradley_terry_margin_is_a_shift_and_large_gaps_stay_finite() -> None:
    gen = torch.Generator().manual_seed(2)
    chosen, rejected = _randn(gen, 8), _randn(gen, 8)
    torch.testing.assert_close(
        bradley_terry_loss(chosen, rejected, 0.5), bradley_terry_loss(chosen - 0.5, rejected)
    )
    torch.testing.assert_close(
        bradley_terry_loss(chosen, rejected, torch.tensor(0.5, dtype=D)),
        bradley_terry_loss(chosen, rejected, 0.5),
    )
    # log(1 + e^-x) at x = ±800: exp overflows in the textbook form, not here
    big = torch.tensor([800.0, -800.0], dtype=D, requires_grad=True)
    loss = bradley_terry_loss(big, torch.zeros(2, dtype=D))
    torch.testing.assert_close(loss.detach(), torch.tensor([0.0, 800.0], dtype=D))
    (grad,) = torch.autograd.grad(loss.sum(), big)
    torch.testing.assert_close(grad, torch.tensor([0.0, -1.0], dtype=D))


@pytest.mark.parametrize("beta", [0.1, 1.0])
@pytest.mark.parametrize("ls", [0.0, 0.1, 0.3])
def test_dpo_sigmoid_equals_the_reference(beta: float, ls: float) -> None:
    gen = torch.Generator().manual_seed(3)
    inputs = tuple(_randn(gen, 32, scale=4) - 20 for _ in range(4))
    cot = _randn(gen, 32)

    def ours_fn(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor):
        return dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="sigmoid", label_smoothing=ls)

    def theirs_fn(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor):
        return ref_dpo_sigmoid(pc, pr, rc, rr, beta, ls)

    _assert_same(_values_and_grads(ours_fn, inputs, cot), _values_and_grads(theirs_fn, inputs, cot))


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_equals_the_reference(beta: float) -> None:
    gen = torch.Generator().manual_seed(4)
    inputs = tuple(_randn(gen, 32, scale=4) - 20 for _ in range(4))
    cot = _randn(gen, 32)

    def ours_fn(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor):
        return dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")

    def theirs_fn(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor):
        return ref_ipo(pc, pr, rc, rr, beta)

    _assert_same(_values_and_grads(ours_fn, inputs, cot), _values_and_grads(theirs_fn, inputs, cot))
    # zero loss exactly where h = 1/(2 beta)
    zero = torch.zeros(1, dtype=D)
    h = torch.full((1,), 1.0 / (2.0 * beta), dtype=D)
    assert float(dpo_loss(h, zero, zero, zero, beta=beta, loss_type="ipo")) == 0.0


def test_label_smoothing_keeps_the_optimum_finite() -> None:
    """Without smoothing the sigmoid loss falls forever as h grows; with ε it is smallest at
    βh = log((1−ε)/ε), and at h = 0 it is log 2 whatever ε."""
    beta, eps = 0.5, 0.1
    zero = torch.zeros(1, dtype=D)
    for ls in (0.0, eps):
        loss = dpo_loss(zero, zero, zero, zero, beta=beta, label_smoothing=ls)
        assert float(loss) == pytest.approx(math.log(2.0), abs=1e-15)
    h_star = torch.full((1,), math.log((1 - eps) / eps) / beta, dtype=D, requires_grad=True)
    loss = dpo_loss(h_star, zero, zero, zero, beta=beta, label_smoothing=eps)
    (grad,) = torch.autograd.grad(loss.sum(), h_star)
    assert abs(float(grad)) < 1e-12
    further = dpo_loss(h_star.detach() + 1.0, zero, zero, zero, beta=beta, label_smoothing=eps)
    assert float(further) > float(loss.detach())
    unsmoothed = dpo_loss(h_star.detach() + 1.0, zero, zero, zero, beta=beta)
    assert float(unsmoothed) < float(dpo_loss(h_star.detach(), zero, zero, zero, beta=beta))


def _four(n: int = 3) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(n, dtype=D) for _ in range(4))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: dpo_loss(*_four(), beta=0.0), "beta"),
        (lambda: dpo_loss(*_four(), beta=-1.0), "beta"),
        (lambda: dpo_loss(*_four(), beta=math.nan), "beta"),
        (lambda: dpo_loss(*_four(), beta=0.1, label_smoothing=0.5), "label_smoothing"),
        (lambda: dpo_loss(*_four(), beta=0.1, label_smoothing=-0.1), "label_smoothing"),
        (
            lambda: dpo_loss(*_four(), beta=0.1, loss_type="ipo", label_smoothing=0.1),
            "label_smoothing",
        ),
        (lambda: dpo_loss(*_four(), beta=0.1, loss_type="hinge"), "loss_type"),  # type: ignore[arg-type]
        (lambda: dpo_loss(*_four()[:3], torch.zeros(4, dtype=D), beta=0.1), "ref_rejected"),
        (lambda: dpo_loss(torch.zeros(2), *_four()[1:], beta=0.1), "policy_rejected"),
        (lambda: dpo_metrics(*_four(), beta=0.0), "beta"),
        (lambda: dpo_metrics(*_four()[:3], torch.zeros(2), beta=1.0), "ref_rejected"),
        (lambda: bradley_terry_loss(torch.zeros(3), torch.zeros(2)), "rejected"),
        (lambda: bradley_terry_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2)), "margin"),
        (lambda: bradley_terry_loss(torch.zeros(3), torch.zeros(3), math.inf), "margin"),
        (lambda: pair_metrics(torch.zeros(3), torch.zeros(1)), "rejected_scores"),
        (lambda: pair_row_weights(torch.zeros(3), torch.zeros(2), bradley_terry_loss), "rejected"),
        (lambda: pair_row_weights(torch.zeros(3, 1), torch.zeros(3, 1), bradley_terry_loss), "[P]"),
        (
            lambda: pair_row_weights(torch.zeros(3), torch.zeros(3), lambda c, r: c.sum()),
            "pair_loss",
        ),
        (lambda: pair_row_weights(torch.zeros(0), torch.zeros(0), bradley_terry_loss), "pair"),
        (lambda: LinearisedPairLoss("values"), "output"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_are_named(call: Callable[[], object], name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_the_names_are_exported() -> None:
    assert PREFERENCE_LOSSES == ("bradley_terry", "dpo_sigmoid", "dpo_ipo")
    assert DPO_LOSS_TYPES == ("sigmoid", "ipo")


# ---------------------------------------------------------------------- the DPO reference
@pytest.mark.parametrize(("loss_type", "ls"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_reference_log_probs_move_the_loss_and_weights_as_the_formula_says(
    loss_type: str, ls: float
) -> None:
    gen = torch.Generator().manual_seed(5)
    pairs, beta = 10, 0.3
    pc, pr = _randn(gen, pairs, scale=3) - 30, _randn(gen, pairs, scale=3) - 30
    refs = [(_randn(gen, pairs, scale=3) - 30, _randn(gen, pairs, scale=3) - 30) for _ in "ab"]
    results = []
    for rc, rr in refs:
        fn = dpo_pair_loss(rc, rr, beta=beta, loss_type=loss_type, label_smoothing=ls)  # type: ignore[arg-type]
        losses, w_chosen, w_rejected = pair_row_weights(pc, pr, fn)
        h = ref_h(pc, pr, rc, rr)
        expected = ref_ipo(pc, pr, rc, rr, beta) if loss_type == "ipo" else None
        if expected is None:
            expected = ref_dpo_sigmoid(pc, pr, rc, rr, beta, ls)
        slope = ref_dpo_dl_dh(h, beta, loss_type, ls) / pairs
        torch.testing.assert_close(losses, expected, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(w_chosen, slope, atol=1e-14, rtol=1e-10)
        torch.testing.assert_close(w_rejected, -slope, atol=1e-14, rtol=1e-10)
        results.append((losses, w_chosen))
    # another reference is another loss: nothing may ignore the reference terms
    assert (results[0][0] - results[1][0]).abs().min() > 1e-6
    assert (results[0][1] - results[1][1]).abs().min() > 1e-9
    # only log-ratios count: moving a response's policy and reference log-prob together is a no-op
    rc, rr = refs[0]
    shift = _randn(gen, pairs)
    moved = pair_row_weights(pc + shift, pr, dpo_pair_loss(rc + shift, rr, beta=beta))
    plain = pair_row_weights(pc, pr, dpo_pair_loss(rc, rr, beta=beta))
    for a, b in zip(moved, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9)


def test_pair_row_weights_work_under_no_grad_in_float64() -> None:
    chosen = torch.tensor([1.0, 0.0], dtype=torch.float32)
    rejected = torch.tensor([0.0, 2.0], dtype=torch.float32)
    with torch.no_grad():
        losses, w_c, w_r = pair_row_weights(chosen, rejected, bradley_terry_loss)
    assert losses.dtype == w_c.dtype == w_r.dtype == D
    # d/dc mean(-log σ(c − r)) = −σ(r − c)/P
    expected = torch.tensor([-1 / (1 + math.e), -1 / (1 + math.exp(-2.0))], dtype=D) / 2
    torch.testing.assert_close(w_c, expected, atol=1e-15, rtol=0)
    torch.testing.assert_close(w_r, -expected, atol=1e-15, rtol=0)
    # a pair loss that ignores a side gives that side zero weight, not an error
    _, w_c, w_r = pair_row_weights(chosen, rejected, lambda c, r: c * 2.0)
    torch.testing.assert_close(w_c, torch.ones(2, dtype=D))
    torch.testing.assert_close(w_r, torch.zeros(2, dtype=D))


# ---------------------------------------------------------------------------- metrics
def test_dpo_metrics_on_hand_made_pairs() -> None:
    # beta 0.5: chosen rewards 0.5*(pc − rc) = [0.25, −0.5, 0], rejected 0.5*(pr − rr) =
    # [−0.5, 0.5, 0]; the third pair is a tie, which is not a win
    metrics = dpo_metrics(
        torch.tensor([-1.0, -2.0, -1.0]),
        torch.tensor([-3.0, -1.0, -2.0]),
        torch.tensor([-1.5, -1.0, -1.0]),
        torch.tensor([-2.0, -2.0, -2.0]),
        beta=0.5,
    )
    assert metrics == pytest.approx(
        {
            "rewards/chosen": -0.25 / 3,
            "rewards/rejected": 0.0,
            "rewards/margin": -0.25 / 3,  # mean(0.75, −1.0, 0)
            "rewards/accuracy": 1 / 3,
        }
    )


def test_pair_metrics_on_hand_made_pairs() -> None:
    metrics = pair_metrics(torch.tensor([1.0, 2.0, 3.0, 0.5]), torch.tensor([0.0, 3.0, 3.0, -1.5]))
    assert metrics == pytest.approx(
        {
            "pair_accuracy": 0.5,  # 1 > 0 and 0.5 > −1.5; a tie is not a win
            "score_margin": 0.5,  # mean(1, −1, 0, 2)
            "score_chosen": 1.625,
            "score_rejected": 1.125,
        }
    )
    with pytest.raises(ValueError, match="at least one pair"):
        pair_metrics(torch.zeros(0), torch.zeros(0))


# ------------------------------------------------------------------ the engine surrogate
def test_sequence_log_probs_sums_response_tokens_only() -> None:
    log_probs = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, math.inf, -math.inf]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(
        sequence_log_probs(log_probs, mask), torch.tensor([-3.0, -0.5], dtype=D)
    )
    with pytest.raises(ValueError, match="log_probs"):
        sequence_log_probs(log_probs[:, :2], mask)


def _meta_batch(tensors: dict[str, torch.Tensor], meta: dict[str, int] | None = None) -> Batch:
    return Batch(tensors, meta={"dp_size": 1} if meta is None else meta)


def test_linearised_loss_names_what_is_missing() -> None:
    scores = torch.zeros(2, dtype=D)
    weights = {PAIR_WEIGHT_KEY: torch.zeros(2, dtype=D)}
    loss_fn = LinearisedPairLoss("scores")
    with pytest.raises(KeyError, match=f"{PAIR_WEIGHT_KEY}.*pair_row_weights"):
        loss_fn({"scores": scores}, _meta_batch({"x": torch.zeros(2)}))
    with pytest.raises(KeyError, match="dp_size"):
        loss_fn({"scores": scores}, _meta_batch(weights, meta={}))
    with pytest.raises(KeyError, match=r"'scores'.*score head"):
        loss_fn({"values": scores}, _meta_batch(weights))
    with pytest.raises(KeyError, match="'log_probs'"):
        LinearisedPairLoss("log_probs")({"scores": scores}, _meta_batch(weights))
    with pytest.raises(KeyError, match="'response_mask'"):
        LinearisedPairLoss("log_probs")({"log_probs": torch.zeros(2, 3)}, _meta_batch(weights))
    with pytest.raises(ValueError, match="one weight per row"):
        loss_fn({"scores": torch.zeros(2, 1)}, _meta_batch(weights))


def test_linearised_loss_multiplies_in_the_wider_dtype() -> None:
    """bf16 scores with float64 weights: the product is not rounded to bf16 (a weight of
    1e-3 + 1e-6 would lose its tail there), and the gradient comes back in bf16."""
    scores = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    weights = torch.tensor([1e-3 + 1e-6, -2e-3], dtype=D)
    loss, metrics = LinearisedPairLoss("scores")(
        {"scores": scores}, _meta_batch({PAIR_WEIGHT_KEY: weights}, {"dp_size": 3})
    )
    assert loss.dtype == D
    assert float(loss.detach()) == pytest.approx(3 * (1e-3 + 1e-6 - 4e-3), abs=1e-15)
    assert metrics == {"pair_surrogate": pytest.approx(1e-3 + 1e-6 - 4e-3, abs=1e-15)}
    (grad,) = torch.autograd.grad(loss, scores)
    assert grad.dtype == torch.bfloat16


# A tiny reward model (a score per row) and a tiny policy (per-token log-probs), float64.
PAIRS, FEATURES, HIDDEN, TOKENS, VOCAB = 6, 5, 4, 7, 9


class World:
    """Rows of 6 pairs in shuffled order, their models' parameters and their pairing."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows = 2 * PAIRS
        order = torch.randperm(rows, generator=gen)
        self.chosen, self.rejected = order[:PAIRS], order[PAIRS:]  # row of pair p's each side
        pair_id = torch.empty(rows, dtype=torch.int64)
        side = torch.empty(rows, dtype=D)
        pair_id[self.chosen], pair_id[self.rejected] = torch.arange(PAIRS), torch.arange(PAIRS)
        side[self.chosen], side[self.rejected] = 1.0, -1.0
        lengths = torch.randint(1, TOKENS + 1, (rows,), generator=gen)
        lengths[0], lengths[1] = 1, TOKENS  # a one-token and a full-width response
        self.lengths = [int(n) for n in lengths]
        self.tensors = {
            "features": _randn(gen, rows, FEATURES),
            "token_features": _randn(gen, rows, TOKENS, FEATURES),
            "tokens": torch.randint(0, VOCAB, (rows, TOKENS), generator=gen),
            "response_mask": (torch.arange(TOKENS)[None, :] < lengths[:, None]).to(torch.int64),
            "pair_id": pair_id,
            "side": side,
        }
        self.score_params = [_randn(gen, HIDDEN, FEATURES), _randn(gen, HIDDEN, scale=2)]
        self.policy_params = [_randn(gen, HIDDEN, FEATURES), _randn(gen, VOCAB, HIDDEN, scale=2)]
        self.ref_params = [p + _randn(gen, *p.shape, scale=0.3) for p in self.policy_params]
        self.margin = 0.5 * torch.rand(PAIRS, generator=gen, dtype=D)

    @staticmethod
    def scores(params: Sequence[torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        hidden, head = params
        return torch.tanh(features @ hidden.T) @ head

    @staticmethod
    def token_log_probs(
        params: Sequence[torch.Tensor], token_features: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        hidden, head = params
        logits = torch.tanh(token_features @ hidden.T) @ head.T
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]

    def response_log_probs(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each row's response log-prob, summed by slicing each row to its length."""
        per_token = self.token_log_probs(
            params, self.tensors["token_features"], self.tensors["tokens"]
        )
        return torch.stack([per_token[i, :n].sum() for i, n in enumerate(self.lengths)])

    def batch(self, weights: torch.Tensor, **extra: torch.Tensor) -> Batch:
        return Batch({**self.tensors, PAIR_WEIGHT_KEY: weights, **extra})

    def row_weights(self, chosen_w: torch.Tensor, rejected_w: torch.Tensor) -> torch.Tensor:
        weights = torch.empty(2 * PAIRS, dtype=D)
        weights[self.chosen], weights[self.rejected] = chosen_w, rejected_w
        return weights


def _random_split(rows: int, ranks: int, gen: torch.Generator) -> Split:
    """Shuffled rows cut into ``ranks`` non-empty parts, each into random micro-batches."""

    def cut(items: list[int], parts: int) -> list[list[int]]:
        points = sorted(torch.randperm(len(items) - 1, generator=gen)[: parts - 1].add(1).tolist())
        return [items[a:b] for a, b in zip([0, *points], [*points, len(items)], strict=True)]

    order = torch.randperm(rows, generator=gen).tolist()
    split = []
    for part in cut(order, ranks):
        micro = int(torch.randint(1, len(part) + 1, (1,), generator=gen))
        split.append(cut(part, micro))
    return split


def _pair_split(world: World, gen: torch.Generator) -> Split:
    """Two ranks whose micro-batches hold whole pairs only."""
    pairs = torch.randperm(PAIRS, generator=gen).tolist()
    rows = [[int(world.chosen[p]), int(world.rejected[p])] for p in pairs]
    return [[rows[0] + rows[1], rows[2]], [rows[3], rows[4] + rows[5]]]


def _engine_gradient(
    params: Sequence[torch.Tensor],
    forward: Callable[[Sequence[torch.Tensor], Batch], dict[str, torch.Tensor]],
    loss_fn: LossFn,
    batch: Batch,
    split: Split,
) -> list[torch.Tensor]:
    """What one train step applies: each rank sums its micro-batches' gradients (every
    micro-batch told ``dp_size``), then the ranks' gradients are averaged."""
    leaves = [p.detach().clone().requires_grad_() for p in params]
    rank_grads = []
    for micro_batches in split:
        total = [torch.zeros_like(p) for p in leaves]
        for rows in micro_batches:
            mb = batch.index(rows)
            mb.meta = {"dp_size": len(split)}
            loss, _ = loss_fn(forward(leaves, mb), mb)
            for acc, grad in zip(total, torch.autograd.grad(loss, leaves), strict=True):
                acc += grad
        rank_grads.append(total)
    return [torch.stack(grads).mean(dim=0) for grads in zip(*rank_grads, strict=True)]


def _autograd_gradient(
    params: Sequence[torch.Tensor], mean_loss: Callable[[list[torch.Tensor]], torch.Tensor]
) -> list[torch.Tensor]:
    leaves = [p.detach().clone().requires_grad_() for p in params]
    return list(torch.autograd.grad(mean_loss(leaves), leaves))


def _assert_grads(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)


def _max_gap(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected, strict=True))


def _tears_pairs(world: World, split: Split) -> tuple[bool, bool]:
    """Whether some pair has its rows in two micro-batches, and some on two ranks."""
    micro_of, rank_of = {}, {}
    for r, micro_batches in enumerate(split):
        for m, rows in enumerate(micro_batches):
            for row in rows:
                micro_of[row], rank_of[row] = (r, m), r
    pairs = list(zip(world.chosen.tolist(), world.rejected.tolist(), strict=True))
    return (
        any(micro_of[c] != micro_of[r] for c, r in pairs),
        any(rank_of[c] != rank_of[r] for c, r in pairs),
    )


def _torn_split(world: World, seed: int) -> Split:
    gen = torch.Generator().manual_seed(100 + seed)
    split = _random_split(2 * PAIRS, 2, gen)
    while _tears_pairs(world, split) != (True, True):
        split = _random_split(2 * PAIRS, 2, gen)
    return split


def _score_forward(params: Sequence[torch.Tensor], mb: Batch) -> dict[str, torch.Tensor]:
    return {"scores": World.scores(params, mb["features"])}


def _policy_forward(params: Sequence[torch.Tensor], mb: Batch) -> dict[str, torch.Tensor]:
    per_token = World.token_log_probs(params, mb["token_features"], mb["tokens"])
    # what padding holds must not matter
    return {"log_probs": torch.where(mb["response_mask"] != 0, per_token, math.nan)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reward_model_surrogate_gives_the_exact_gradient_however_pairs_are_torn(
    seed: int,
) -> None:
    world = World(seed)
    margin = world.margin

    def mean_loss(params: list[torch.Tensor]) -> torch.Tensor:
        scores = World.scores(params, world.tensors["features"])
        return ref_bradley_terry(scores[world.chosen], scores[world.rejected], margin).mean()

    expected = _autograd_gradient(world.score_params, mean_loss)
    with torch.no_grad():  # the driver's pre-step forward
        scores = World.scores(world.score_params, world.tensors["features"])
    losses, w_c, w_r = pair_row_weights(
        scores[world.chosen], scores[world.rejected], lambda c, r: bradley_terry_loss(c, r, margin)
    )
    torch.testing.assert_close(losses.mean(), mean_loss(world.score_params), atol=1e-12, rtol=0)
    batch = world.batch(world.row_weights(w_c, w_r))
    split = _torn_split(world, seed)
    actual = _engine_gradient(
        world.score_params, _score_forward, LinearisedPairLoss("scores"), batch, split
    )
    _assert_grads(actual, expected)
    assert _max_gap(actual, expected) < 1e-12


def _naive_dpo(beta: float, loss_type: str, ls: float) -> LossFn:
    """A per-micro-batch DPO: the pairs whose two rows it holds, each 1/P x dp_size; a row
    whose partner is elsewhere contributes nothing (it cannot be paired)."""

    def loss_fn(
        outputs: dict[str, torch.Tensor], mb: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        seq = sequence_log_probs(outputs["log_probs"], mb["response_mask"])
        total = 0.0 * seq.sum()  # a micro-batch without a whole pair still has a graph
        ids, side = mb["pair_id"].tolist(), mb["side"].tolist()
        for p in set(ids):
            rows = [i for i, q in enumerate(ids) if q == p]
            if len(rows) < 2:
                continue
            c = next(i for i in rows if side[i] > 0)
            r = next(i for i in rows if side[i] < 0)
            total = (
                total
                + dpo_loss(
                    seq[c : c + 1],
                    seq[r : r + 1],
                    mb["ref_seq"][c : c + 1],
                    mb["ref_seq"][r : r + 1],
                    beta=beta,
                    loss_type=loss_type,  # type: ignore[arg-type]
                    label_smoothing=ls,
                ).sum()
            )
        return total / PAIRS * mb.meta["dp_size"], {}

    return loss_fn


@pytest.mark.parametrize(("loss_type", "ls"), [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_surrogate_gives_the_exact_gradient_and_a_naive_loss_does_not(
    loss_type: str, ls: float, seed: int
) -> None:
    world = World(seed)
    beta = 0.2 if loss_type == "ipo" else 0.5
    with torch.no_grad():
        ref_seq = world.response_log_probs(world.ref_params)
    rc, rr = ref_seq[world.chosen], ref_seq[world.rejected]

    def mean_loss(params: list[torch.Tensor]) -> torch.Tensor:
        seq = world.response_log_probs(params)
        pc, pr = seq[world.chosen], seq[world.rejected]
        if loss_type == "ipo":
            return ref_ipo(pc, pr, rc, rr, beta).mean()
        return ref_dpo_sigmoid(pc, pr, rc, rr, beta, ls).mean()

    expected = _autograd_gradient(world.policy_params, mean_loss)
    assert max(float(g.abs().max()) for g in expected) > 1e-2  # a gradient worth comparing

    with torch.no_grad():  # the driver's pre-step forward, summed as the engine loss sums
        per_token = World.token_log_probs(
            world.policy_params, world.tensors["token_features"], world.tensors["tokens"]
        )
        seq = sequence_log_probs(per_token, world.tensors["response_mask"])
    pair_loss = dpo_pair_loss(rc, rr, beta=beta, loss_type=loss_type, label_smoothing=ls)  # type: ignore[arg-type]
    losses, w_c, w_r = pair_row_weights(seq[world.chosen], seq[world.rejected], pair_loss)
    torch.testing.assert_close(losses.mean(), mean_loss(world.policy_params), atol=1e-12, rtol=0)
    batch = world.batch(world.row_weights(w_c, w_r), ref_seq=ref_seq)

    split = _torn_split(world, seed)
    surrogate = LinearisedPairLoss("log_probs")
    actual = _engine_gradient(world.policy_params, _policy_forward, surrogate, batch, split)
    _assert_grads(actual, expected)
    assert _max_gap(actual, expected) < 1e-12

    # the control: right when each micro-batch holds whole pairs, wrong when pairs are torn
    naive = _naive_dpo(beta, loss_type, ls)
    whole = _pair_split(world, torch.Generator().manual_seed(seed))
    _assert_grads(
        _engine_gradient(world.policy_params, _policy_forward, naive, batch, whole), expected
    )
    torn = _engine_gradient(world.policy_params, _policy_forward, naive, batch, split)
    assert _max_gap(torn, expected) > 1e-3
