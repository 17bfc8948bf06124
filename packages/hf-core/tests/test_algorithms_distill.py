"""On-policy distillation's signal against a plain loop over the formula, and the truncation
test DAPO's overlong filtering uses."""

from __future__ import annotations

import torch

from hf_core.algorithms import truncated_responses
from hf_core.algorithms.distill import reverse_kl_advantage
from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig
from hf_core.roles.losses import PolicyLoss


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(4, 6, generator=gen)
    student = -torch.rand(4, 6, generator=gen) * 3
    teacher = -torch.rand(4, 6, generator=gen) * 3
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    )
    return adv, student, teacher, mask


def test_reverse_kl_advantage_adds_the_teacher_gap_per_token() -> None:
    adv, student, teacher, mask = _inputs()
    out, metrics = reverse_kl_advantage(adv, student, teacher, mask, coef=0.5)
    gaps: list[float] = []
    for b in range(4):
        for t in range(6):
            if mask[b, t]:
                gap = float(teacher[b, t] - student[b, t])
                assert abs(float(out[b, t]) - (float(adv[b, t]) + 0.5 * gap)) < 1e-6
                gaps.append(-gap)
            else:
                assert float(out[b, t]) == 0.0  # padding and the empty response
    assert abs(metrics["distill/reverse_kl"] - sum(gaps) / len(gaps)) < 1e-6


def test_reverse_kl_advantage_is_zero_when_teacher_and_student_agree() -> None:
    adv, student, _, mask = _inputs(1)
    out, metrics = reverse_kl_advantage(torch.zeros_like(adv), student, student, mask, 1.0)
    assert torch.equal(out, torch.zeros_like(out))
    assert metrics["distill/reverse_kl"] == 0.0


def test_reverse_kl_advantage_carries_no_gradient_into_the_log_probs() -> None:
    adv, student, teacher, mask = _inputs(2)
    student = student.clone().requires_grad_()
    out, _ = reverse_kl_advantage(adv, student, teacher, mask, 1.0)
    assert not out.requires_grad  # advantages are constants of the policy-gradient loss


def test_loss_mode_adds_coef_times_the_kl_to_the_teacher() -> None:
    _, student, teacher, mask = _inputs(3)
    algo = AlgorithmConfig.model_validate({"distill": {"mode": "loss", "coef": 0.3}})
    batch = Batch(
        {
            "response_mask": mask,
            "advantages": torch.zeros(4, 6),
            "rollout_log_probs": student,
            "teacher_log_probs": teacher,
        }
    )
    batch.meta.update(dp_size=1, global_batch_size=4, global_response_tokens=int(mask.sum()))
    log_probs = student.clone().requires_grad_()
    loss, metrics = PolicyLoss(algo)({"log_probs": log_probs}, batch)
    # zero advantages: the whole loss is the distillation term, k2 = ½(log π_s − log π_t)²
    valid = mask.bool()
    k2 = 0.5 * (student - teacher)[valid].square().mean()
    assert abs(float(loss.detach()) - 0.3 * float(k2)) < 1e-6
    assert abs(metrics["distill_loss"] - float(k2)) < 1e-6
    loss.backward()
    expected = 0.3 * (student - teacher) * valid / valid.sum()
    assert torch.allclose(log_probs.grad, expected, atol=1e-6)


def test_truncated_responses_are_full_length_without_a_stop_token() -> None:
    eos = 2
    responses = torch.tensor([[5, 6, 7, 8], [5, 6, 7, eos], [5, eos, 0, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]])
    # row 3: an agent trajectory (a masked tool span) that ends at the limit: cut as well
    assert truncated_responses(responses, mask, 4, [eos]).tolist() == [True, False, False, True]
    assert truncated_responses(responses, mask, 5, [eos]).tolist() == [False] * 4
    empty = torch.zeros(1, 4, dtype=torch.long)
    assert truncated_responses(empty, empty, 4, [eos]).tolist() == [False]
