"""The oneDNN linear path agrees with aten's float32 linear, in values and gradients, alone and
inside the FSDP engine; small calls stay on aten.

Every comparison has aten (``F.linear``, ``cpu_linear: aten``) on one side, and counts the
oneDNN op's calls on the other: two oneDNN sides would agree on a shared bug, and a swapped
class whose calls never reach oneDNN would compare aten with itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_fsdp import onednn_linear as onednn_module
from hf_fsdp.engine import FSDPEngine
from hf_fsdp.onednn_linear import (
    LARGE_WEIGHT_BYTES,
    MIN_ROWS,
    THREADED_WEIGHT_BYTES,
    OneDNNLinear,
    linear,
    onednn_linear_available,
)
from hf_fsdp.rollout import TransformersRolloutEngine
from hf_testing.workers import policy_loss, rollout_batch

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")

VOCAB = 128


@pytest.fixture(autouse=True)
def mkl_untuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules as on a CPU MKL is not tuned for (AMD), wherever the tests run: on Intel
    only the large-weight rule applies (``test_on_intel_only_large_weights_take_onednn``)."""
    monkeypatch.setattr(onednn_module, "_mkl_tuned_here", lambda: False)


@pytest.fixture(scope="module")
def biased_qwen2(models: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with random q/k/v biases: freshly built ones are all zero, which no
    bias handling could get wrong."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = models["qwen2_tied"]
    model = AutoModelForCausalLM.from_pretrained(source)
    gen = torch.Generator().manual_seed(11)
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    assert biases
    with torch.no_grad():
        for bias in biases:
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.5)
    folder = tmp_path_factory.mktemp("biased") / "qwen2_biased"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture
def onednn_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The row count of every call of the oneDNN op (``torch.ops.mkldnn._linear_pointwise``)."""
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    yield calls


def _grads(fn, x, w, b):  # type: ignore[no-untyped-def]
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = fn(x, w, b)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("input_grad_on_onednn", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("rows", [MIN_ROWS, 3 * MIN_ROWS + 7])
def test_values_and_gradients_match_aten(
    rows: int, input_grad_on_onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both input-gradient routes (oneDNN on a transposed weight copy for AVX-512 CPUs,
    aten's ``grad @ weight`` for AVX2-only ones) give aten's gradients."""
    monkeypatch.setattr(onednn_module, "_input_grad_on_onednn", lambda: input_grad_on_onednn)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows // 4 + 1, 4, 96, generator=gen)[: rows // 4 + (rows % 4 > 0)]
    w, b = torch.randn(160, 96, generator=gen), torch.randn(160, generator=gen)
    ours, ref = _grads(linear, x, w, b), _grads(F.linear, x, w, b)
    for name, a, r in zip(("out", "d_input", "d_weight", "d_bias"), ours, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4, msg=name)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_calls_without_autograd_match_aten(bias: bool, mode: str, onednn_calls: list[int]) -> None:
    """The forward-only path (log-probs, generation; Qwen2's q/k/v carry a bias) runs oneDNN
    directly, outside the autograd function the gradient test goes through."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2 * MIN_ROWS // 3 + 1, 96, generator=gen)
    w = torch.randn(160, 96, generator=gen)
    b = torch.randn(160, generator=gen) if bias else None
    if mode == "no_grad":
        with torch.no_grad():
            ours = linear(x, w, b)
    elif mode == "inference_mode":
        with torch.inference_mode():
            ours = linear(x, w, b)
    else:  # grad mode on, nothing requires it (a frozen reference model)
        ours = linear(x, w, b)
    assert onednn_calls == [x.shape[0] * x.shape[1]]  # one oneDNN call over all the rows
    assert not ours.requires_grad and ours.shape == (*x.shape[:-1], 160)
    torch.testing.assert_close(ours, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_small_and_non_float32_calls_stay_on_aten(onednn_calls: list[int]) -> None:
    calls = onednn_calls
    w = torch.randn(32, 16)
    linear(torch.randn(MIN_ROWS - 1, 16), w, None)
    linear(torch.randn(MIN_ROWS, 16, dtype=torch.float64), w.double(), None)
    assert calls == []
    linear(torch.randn(2, MIN_ROWS // 2, 16), w, None)
    assert calls == [MIN_ROWS]


def test_on_intel_only_large_weights_take_onednn(
    onednn_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where MKL runs its own best kernels, many rows over a small weight stay on aten, a
    large weight still streams through oneDNN, and the input gradient is aten's."""
    monkeypatch.setattr(onednn_module, "_mkl_tuned_here", lambda: True)
    onednn_module._input_grad_on_onednn.cache_clear()
    try:
        assert not onednn_module._input_grad_on_onednn()
    finally:
        onednn_module._input_grad_on_onednn.cache_clear()
    linear(torch.randn(4 * MIN_ROWS, 16), torch.randn(32, 16), None)
    assert onednn_calls == []
    linear(torch.randn(4, 256), torch.randn(LARGE_WEIGHT_BYTES // 4 // 256, 256), None)
    assert onednn_calls == [4]


def test_large_weights_take_onednn_at_any_row_count(onednn_calls: list[int]) -> None:
    """A decode step's few rows over a weight too large for the caches go to oneDNN (aten's
    sgemm repacks the weight per call); a mid-sized weight does so only with more than one
    thread.  Values match aten's."""
    gen = torch.Generator().manual_seed(3)
    large = torch.randn(LARGE_WEIGHT_BYTES // 4 // 256, 256, generator=gen)
    mid = torch.randn(THREADED_WEIGHT_BYTES // 4 // 256, 256, generator=gen)
    x = torch.randn(4, 256, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.testing.assert_close(
            linear(x, large, None), F.linear(x, large, None), rtol=1e-5, atol=1e-4
        )
        linear(x, mid, None)
        assert onednn_calls == [4]
        torch.set_num_threads(2)
        torch.testing.assert_close(
            linear(x, mid, None), F.linear(x, mid, None), rtol=1e-5, atol=1e-4
        )
        assert onednn_calls == [4, 4]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("folder", ["llama", "qwen2_biased"])  # no biases; q/k/v biases
def test_engines_swap_their_linear_layers_and_train_the_same(
    models: dict, biased_qwen2: Path, folder: str, onednn_calls: list[int]
) -> None:
    path = str(biased_qwen2 if folder == "qwen2_biased" else models[folder])
    batch = rollout_batch(64, 12, 20, VOCAB, seed=3)  # 64 x 32 tokens: the oneDNN path
    results = {}
    for kind in ("onednn", "aten"):
        engine = FSDPEngine({"model_path": path, "seed": 0, "cpu_linear": kind})
        linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, OneDNNLinear) == (kind == "onednn") for m in linears)
        onednn_calls.clear()
        metrics = [engine.train_step(batch, policy_loss) for _ in range(2)]
        trained = len(onednn_calls)
        log_probs = engine.compute_log_probs(batch)["log_probs"]
        recomputed = len(onednn_calls) - trained
        if kind == "onednn":  # the op ran, in the update and in the forward-only pass
            assert trained >= 2 * len(linears) and recomputed >= len(linears)
        else:
            assert onednn_calls == []
        results[kind] = (metrics, log_probs)
    (ours, ours_lp), (ref, ref_lp) = results["onednn"], results["aten"]
    for a, r in zip(ours, ref, strict=True):
        assert a["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert a["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp, ref_lp, rtol=0, atol=1e-5)


def test_onednn_rollout_matches_an_aten_training_engine(
    biased_qwen2: Path, onednn_calls: list[int]
) -> None:
    """Rollout (oneDNN, forward only) against training (aten): the greedy log-probs agree on a
    model with q/k/v biases, and the rollout's prefill really ran oneDNN."""
    path = str(biased_qwen2)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (16, 8), generator=gen)  # 128 prefill rows: oneDNN
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0  # some left padding
    rollout = TransformersRolloutEngine(
        {"model_path": path, "cpu_linear": "onednn", "dtype": "float32"}
    )
    assert any(isinstance(m, OneDNNLinear) for m in rollout.model.modules())
    out = rollout.generate(
        Batch({"input_ids": ids, "attention_mask": mask}),
        SamplingParams(temperature=0, max_new_tokens=6),
    )
    assert any(rows >= MIN_ROWS for rows in onednn_calls)
    onednn_calls.clear()
    trainer = FSDPEngine({"model_path": path, "trainable": False, "cpu_linear": "aten"})
    recomputed = trainer.compute_log_probs(out, temperature=0.0)["log_probs"]
    assert onednn_calls == []  # the reference side is aten only
    diff = (recomputed - out["rollout_log_probs"]) * out["response_mask"]
    assert out["response_mask"].any() and float(diff.abs().max()) < 1e-4


def test_bfloat16_layers_on_a_cpu_without_bfloat16_instructions_compute_in_float32(
    models: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an AVX2-only CPU the swapped layers widen bfloat16 products to float32 (torch would
    emulate them, 18x slower on a 25M update) and train as native bfloat16 layers do, to
    rounding."""
    from hf_core import device
    from hf_testing.dispatch import MatmulDtypes

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    batch = rollout_batch(16, 12, 20, VOCAB, seed=3)
    results = {}
    for kind in ("onednn", "aten"):  # widened, then torch's own bfloat16 kernels
        engine = FSDPEngine(
            {
                "model_path": str(models["llama"]),
                "seed": 0,
                "cpu_linear": kind,
                "param_dtype": "bfloat16",
            }
        )
        linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
        with MatmulDtypes() as seen:
            metrics = engine.train_step(batch, policy_loss)
        wide = seen.dtypes.count(torch.float32)
        if kind == "onednn":  # forward, input and weight gradients of every layer
            assert wide >= 3 * len(linears)
        else:
            assert wide == 0
        results[kind] = metrics
    assert results["onednn"]["loss"] == pytest.approx(results["aten"]["loss"], rel=2e-2, abs=1e-3)
    assert results["onednn"]["grad_norm"] == pytest.approx(results["aten"]["grad_norm"], rel=5e-2)
