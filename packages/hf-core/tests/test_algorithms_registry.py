"""Name registries and masked helpers of ``hf_core.algorithms``.

Sources: the masked statistics follow the usual PPO-implementation conventions (OpenAI
baselines / verl ``masked_whiten``: unbiased variance over valid tokens, (x − μ)/sqrt(σ² + ε)).
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_core.algorithms as algorithms
from hf_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownAlgorithmError,
    get_advantage_estimator,
    get_aggregation_mode,
    get_kl_estimator,
    get_policy_loss,
    group_ids,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

D = torch.float64


def test_builtins_are_registered() -> None:
    assert {"gae", "grpo", "dr_grpo", "rloo", "remax", "reinforce_plus_plus"} <= set(
        ADVANTAGE_ESTIMATORS.names()
    )
    assert {"ppo_clip", "dual_clip"} <= set(POLICY_LOSSES.names())
    assert {"k1", "k2", "k3", "abs"} <= set(KL_ESTIMATORS.names())
    assert {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "group-mean-token-mean",
    } <= set(AGGREGATION_MODES.names())


@pytest.mark.parametrize(
    ("getter", "kind", "typo", "suggestion"),
    [
        (get_advantage_estimator, "advantage estimator", "gea", "gae"),
        (get_policy_loss, "policy loss", "ppo-clip", "ppo_clip"),
        (get_kl_estimator, "KL estimator", "k33", "k3"),
        (get_aggregation_mode, "loss aggregation mode", "token_mean", "token-mean"),
    ],
)
def test_unknown_names_list_what_is_available(getter, kind, typo, suggestion) -> None:
    with pytest.raises(UnknownAlgorithmError) as error:
        getter(typo)
    message = str(error.value)
    assert message.startswith(f"unknown {kind} {typo!r}; available: ")
    assert f"did you mean {suggestion!r}?" in message
    assert isinstance(error.value, KeyError)  # callers catching KeyError still work


def test_unknown_name_without_close_match() -> None:
    with pytest.raises(UnknownAlgorithmError) as error:
        get_advantage_estimator("zzzzzz")
    assert "did you mean" not in str(error.value)
    assert "gae, grpo" in str(error.value)  # sorted list


def test_registry_register_aliases_and_duplicates() -> None:
    registry: Registry = Registry("widget")

    @registry.register("a", "alias")
    def a() -> int:
        return 1

    assert registry.get("alias") is a and "a" in registry and len(registry) == 2
    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.register("a")(lambda: 2)
    registry.register("a", override=True)(lambda: 2)
    assert registry.get("a")() == 2
    with pytest.raises(UnknownAlgorithmError, match=r"unknown widget 'b'; available: a, alias"):
        registry.get("b")
    with pytest.raises(ValueError, match="at least one name"):
        registry.register()


def test_estimators_declare_what_their_dataflow_needs() -> None:
    from hf_core.algorithms import ESTIMATOR_TRAITS, EstimatorTraits, get_estimator_traits

    assert get_estimator_traits("gae") == EstimatorTraits(needs_critic=True)
    for name in ("grpo", "dr_grpo", "rloo"):
        assert get_estimator_traits(name) == EstimatorTraits(needs_groups=True)
    assert get_estimator_traits("remax") == EstimatorTraits(needs_greedy_baseline=True)
    assert get_estimator_traits("reinforce++") == EstimatorTraits()
    assert ESTIMATOR_TRAITS.names() == ADVANTAGE_ESTIMATORS.names()  # every estimator has traits
    with pytest.raises(UnknownAlgorithmError, match="did you mean 'gae'"):
        get_estimator_traits("gea")


def test_a_new_estimator_registers_its_traits(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_core.algorithms import registry as registry_module

    monkeypatch.setattr(registry_module, "ADVANTAGE_ESTIMATORS", ADVANTAGE_ESTIMATORS.copy())
    monkeypatch.setattr(
        registry_module, "ESTIMATOR_TRAITS", registry_module.ESTIMATOR_TRAITS.copy()
    )

    @registry_module.advantage_estimator("paired", needs_groups=True, needs_critic=True)
    def paired(rewards, mask, **_):
        return rewards, rewards

    traits = registry_module.get_estimator_traits("paired")
    assert traits.needs_groups and traits.needs_critic and not traits.needs_greedy_baseline
    assert registry_module.get_advantage_estimator("paired") is paired


def test_every_public_name_is_exported() -> None:
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name


# -------------------------------------------------------------------------------- masked math
def test_masked_sum_mean_ignore_padding_including_nan() -> None:
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(values, mask).item() == 7.0
    assert masked_mean(values, mask).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0], dtype=D))
    torch.testing.assert_close(masked_sum(values, mask, dim=-1), torch.tensor([3.0, 4.0], dtype=D))


def test_masked_mean_of_nothing_is_zero_and_shapes_must_match() -> None:
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
    with pytest.raises(ValueError, match="mask has shape"):
        masked_mean(torch.ones(2, 2), torch.ones(2, 3))


def test_masked_var_and_whiten_by_hand() -> None:
    # valid values 1, 2, 3, 6: mean 3; squared deviations 4, 1, 0, 9 = 14;
    # biased var 14/4 = 3.5, unbiased 14/3; whitened = (x - 3)/sqrt(14/3).
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, 6.0, -99.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_var(values, mask).item() == pytest.approx(14 / 3)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(3.5)
    s = math.sqrt(14 / 3)
    expected = torch.tensor([[-2 / s, -1 / s, 0.0], [0.0, 3 / s, 0.0]], dtype=D)
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    torch.testing.assert_close(
        masked_whiten(values, mask, shift_mean=False),
        torch.where(mask.bool(), expected + 3.0, 0.0),
    )
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_group_ids() -> None:
    assert group_ids(6, group_size=3).tolist() == [0, 0, 0, 1, 1, 1]
    assert group_ids(4, index=["x", "y", "x", "z"]).tolist() == [0, 1, 0, 2]
    assert group_ids(3, index=torch.tensor([9, 9, 4])).tolist() == [0, 0, 1]


def test_algorithms_layer_imports_no_runtime_or_backends() -> None:
    # The algorithms package sits below the runtime: importing it in a fresh interpreter must
    # not pull in Ray or any backend.
    import subprocess
    import sys

    code = (
        "import sys, hf_core.algorithms\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'hf_fsdp', 'hf_megatron', 'hf_vllm', 'hf_sglang') "
        "or m.startswith(('hf_core.runtime', 'hf_core.roles', 'hf_core.worker'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
