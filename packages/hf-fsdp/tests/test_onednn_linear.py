"""The oneDNN linear path agrees with aten's float32 linear, in values and gradients, alone and
inside the FSDP engine; small calls stay on aten."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_fsdp.engine import FSDPEngine
from hf_fsdp.onednn_linear import MIN_ROWS, OneDNNLinear, linear, onednn_linear_available
from hf_fsdp.rollout import HFRolloutEngine
from hf_testing.workers import policy_loss, rollout_batch

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")

VOCAB = 128


def _grads(fn, x, w, b):  # type: ignore[no-untyped-def]
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = fn(x, w, b)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("rows", [MIN_ROWS, 3 * MIN_ROWS + 7])
def test_values_and_gradients_match_aten(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows // 4 + 1, 4, 96, generator=gen)[: rows // 4 + (rows % 4 > 0)]
    w, b = torch.randn(160, 96, generator=gen), torch.randn(160, generator=gen)
    ours, ref = _grads(linear, x, w, b), _grads(F.linear, x, w, b)
    for name, a, r in zip(("out", "d_input", "d_weight", "d_bias"), ours, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4, msg=name)


def test_small_and_non_float32_calls_stay_on_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    w = torch.randn(32, 16)
    linear(torch.randn(MIN_ROWS - 1, 16), w, None)
    linear(torch.randn(MIN_ROWS, 16, dtype=torch.float64), w.double(), None)
    assert calls == []
    linear(torch.randn(2, MIN_ROWS // 2, 16), w, None)
    assert calls == [MIN_ROWS]


def test_engines_swap_their_linear_layers_and_train_the_same(models: dict) -> None:
    path = str(models["llama"])
    batch = rollout_batch(64, 12, 20, VOCAB, seed=3)  # 64 x 32 tokens: the oneDNN path
    results = {}
    for kind in ("onednn", "aten"):
        engine = FSDPEngine({"model_path": path, "seed": 0, "cpu_linear": kind})
        linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, OneDNNLinear) == (kind == "onednn") for m in linears)
        metrics = [engine.train_step(batch, policy_loss) for _ in range(2)]
        log_probs = engine.compute_log_probs(batch)["log_probs"]
        results[kind] = (metrics, log_probs)
    (ours, ours_lp), (ref, ref_lp) = results["onednn"], results["aten"]
    for a, r in zip(ours, ref, strict=True):
        assert a["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert a["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp, ref_lp, rtol=0, atol=1e-5)
    rollout = HFRolloutEngine({"model_path": path})
    assert any(isinstance(m, OneDNNLinear) for m in rollout.model.modules())
