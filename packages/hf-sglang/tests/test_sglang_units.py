"""Fast checks without an engine: plugin loading, the missing-SGLang error, config, outputs,
sampling parameters and the CPU harness's kernel stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_core.engines import SamplingParams

BLOCK_SGLANG = "import sys; sys.modules['sglang'] = None\n"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )


def test_plugin_is_listed_and_loads_without_importing_sglang() -> None:
    code = BLOCK_SGLANG + (
        "import json\n"
        "from hf_core.plugins import list_backends\n"
        "info = {b.plugin: b.rollout_engines for b in list_backends()}\n"
        "print(json.dumps({'sglang': info.get('sglang'), "
        "'imported': [m for m in sys.modules if m.startswith('sglang')]}))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["sglang"] == ["sglang"]
    assert report["imported"] == ["sglang"]  # only our blocking placeholder, never imported


def test_cli_lists_the_backend_without_sglang() -> None:
    code = (
        BLOCK_SGLANG + "from hf_core.cli import main\nsys.argv = ['hybridflow', 'backends']\nmain()"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "hf-sglang" in result.stdout and "sglang" in result.stdout


def test_missing_sglang_is_a_clear_error_naming_the_extra(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    code = BLOCK_SGLANG + (
        "from hf_core.plugins import get_rollout_engine\n"
        "from hf_sglang.runtime import SGLangNotInstalledError\n"
        f"try:\n    get_rollout_engine('sglang')(model_path={str(tmp_path)!r}, device='cpu')\n"
        "except SGLangNotInstalledError as exc:\n    print('ERROR:', exc)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert 'pip install "hf-sglang[gpu]"' in result.stdout
    assert "'sglang' rollout engine needs SGLang" in result.stdout


def test_config_errors_name_the_key() -> None:
    from hf_core.config import EngineConfigError
    from hf_sglang.config import parse_config

    with pytest.raises(EngineConfigError, match=r"weight_synk: unknown key"):
        parse_config({"model_path": "/x", "weight_synk": "tensor"})
    with pytest.raises(EngineConfigError, match=r"weight_sync: got 'nccl'"):
        parse_config({"model_path": "/x", "weight_sync": "nccl"})
    cfg = parse_config({"model_path": "/x", "weight_sync": "distributed"})
    assert cfg.sync_group.backend == "auto" and cfg.sync_group.master_port == 0


def test_engine_kwargs_for_cpu_and_overrides() -> None:
    from hf_sglang.config import SGLangRolloutConfig
    from hf_sglang.engine import engine_kwargs

    cfg = SGLangRolloutConfig(model_path="/m", engine_kwargs={"max_total_tokens": 99})
    kwargs = engine_kwargs(cfg, "cpu")
    assert kwargs["attention_backend"] == "torch_native" and kwargs["dtype"] == "float32"
    assert kwargs["skip_tokenizer_init"] is True and kwargs["max_total_tokens"] == 99
    assert "enable_memory_saver" not in kwargs
    assert engine_kwargs(cfg, "cuda")["enable_memory_saver"] is True


class _ServerInfo:
    """An engine stand-in answering ``get_server_info`` as SGLang does after start-up."""

    def get_server_info(self) -> dict:
        return {"max_total_num_tokens": 1000}


def test_memory_tags_report_weight_and_kv_cache_bytes(tiny_model: Path) -> None:
    """What release/resume report on the CPU (where they free nothing): the canonical
    weights (the tied embedding once) at the engine's dtype, and the configured KV cache."""
    from transformers import AutoConfig

    from hf_sglang.config import SGLangRolloutConfig
    from hf_sglang.engine import CPU_MAX_TOTAL_TOKENS, engine_kwargs, memory_tag_bytes
    from hf_sglang.weights import canonical_shapes

    shapes = canonical_shapes(tiny_model)
    hf = AutoConfig.from_pretrained(tiny_model)
    assert hf.tie_word_embeddings and "lm_head.weight" not in shapes
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    head_dim = hf.hidden_size // hf.num_attention_heads
    per_token = hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim

    cpu = engine_kwargs(SGLangRolloutConfig(model_path=tiny_model), "cpu")
    tags = memory_tag_bytes(tiny_model, shapes, torch.float32, _ServerInfo(), cpu)
    assert tags == {"weights": 4 * numel, "kv_cache": 4 * per_token * CPU_MAX_TOTAL_TOKENS}

    # on a GPU without max_total_tokens SGLang sizes the cache; fp8 KV counts one byte
    cfg = SGLangRolloutConfig(model_path=tiny_model, engine_kwargs={"kv_cache_dtype": "fp8_e5m2"})
    gpu = engine_kwargs(cfg, "cuda")
    tags = memory_tag_bytes(tiny_model, shapes, torch.bfloat16, _ServerInfo(), gpu)
    assert tags == {"weights": 2 * numel, "kv_cache": per_token * 1000}


def fake_output(tokens: list[int], logps: list[float]) -> dict:
    entries = [(lp, t, None) for lp, t in zip(logps, tokens, strict=True)]
    return {"output_ids": tokens, "meta_info": {"output_token_logprobs": entries}}


def test_pack_outputs_right_pads() -> None:
    from hf_sglang.outputs import pack_outputs, strip_left_padding

    outputs = [fake_output([5, 2], [-0.5, -0.25]), fake_output([7, 8, 9], [-1.0, -2.0, -3.0])]
    responses, log_probs, mask = pack_outputs(outputs, 4, pad_token_id=0, dtype=torch.long)
    assert responses.tolist() == [[5, 2, 0, 0], [7, 8, 9, 0]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert log_probs[1, :3].tolist() == [-1.0, -2.0, -3.0] and log_probs[0, 2] == 0.0
    ids = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 8]])
    assert strip_left_padding(ids, (ids > 0).long()) == [[3, 4], [5, 6, 7, 8]]
    with pytest.raises(RuntimeError, match="asked for 2"):
        pack_outputs(outputs, 2, pad_token_id=0, dtype=torch.long)
    bad = {"output_ids": [5], "meta_info": {"output_token_logprobs": [(-1.0, 6, None)]}}
    with pytest.raises(RuntimeError, match="for token 6"):
        pack_outputs([bad], 4, pad_token_id=0, dtype=torch.long)


def test_sampling_params_mapping() -> None:
    from hf_sglang.sampling import request_params

    greedy = request_params(
        SamplingParams(temperature=0.0, top_k=5, seed=3),
        2,
        stop_token_ids=[2, 2, 9],
        ignore_eos=False,
    )
    assert greedy[0]["temperature"] == 0.0 and greedy[0]["top_k"] == -1
    assert greedy[0]["stop_token_ids"] == [2, 9] and "sampling_seed" not in greedy[0]
    sampled = request_params(
        SamplingParams(temperature=0.8, top_p=0.9, seed=3), 3, stop_token_ids=[2], ignore_eos=True
    )
    assert sampled[0]["top_p"] == 0.9 and sampled[0]["ignore_eos"] is True
    assert sampled[0]["stop_token_ids"] == []
    seeds = [r["sampling_seed"] for r in sampled]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**62 for s in seeds)


def test_check_result_raises_on_failure() -> None:
    from hf_sglang.weights import WeightSyncError, check_result

    check_result("x", (True, "Success"))
    with pytest.raises(WeightSyncError, match="update failed: boom"):
        check_result("update", (False, "boom"))


def test_cpu_stand_in_assigns_like_the_triton_kernel() -> None:
    kernel = pytest.importorskip("sgl_kernel")
    if not getattr(kernel, "IS_HF_SGLANG_TEST_STAND_IN", False):
        pytest.skip("the real sgl_kernel is installed")
    table = torch.full((4, 8), -1, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 107, dtype=torch.int64)
    kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 5]), torch.tensor([5, 8]), out_cache_loc, 8
    )
    assert table[2].tolist() == [-1, 100, 101, 102, 103, -1, -1, -1]
    assert table[0].tolist() == [-1, -1, -1, -1, -1, 104, 105, 106]
    assert (table[[1, 3]] == -1).all()
    with pytest.raises(NotImplementedError, match="not covered on CPU"):
        kernel.verify_tree_greedy_cpu()
