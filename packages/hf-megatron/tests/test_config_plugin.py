"""Config validation, plugin registration, the CPU compatibility layer, the lr schedule."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hf_megatron.config import EngineConfigError, MegatronEngineConfig, parse_config


def test_config_errors_name_key_value_and_expectation() -> None:
    with pytest.raises(EngineConfigError) as err:
        parse_config(
            MegatronEngineConfig,
            {"model_path": "m", "tensor_paralel_size": 2, "lr": -1.0, "head": "policy"},
        )
    text = str(err.value)
    assert "tensor_paralel_size: unknown key (got 2)" in text and "tensor_parallel_size" in text
    assert "lr: got -1.0" in text and "head: got 'policy'" in text
    with pytest.raises(EngineConfigError, match="needs total_steps"):
        parse_config(MegatronEngineConfig, {"model_path": "m", "lr_schedule": "cosine"})
    with pytest.raises(EngineConfigError, match="Transformer Engine"):
        parse_config(
            MegatronEngineConfig,
            {"model_path": "m", "sequence_parallel": True, "layer_spec": "local"},
        )


def test_lr_schedule_has_hf_fsdp_semantics() -> None:
    cfg = MegatronEngineConfig(
        model_path="m", lr_schedule="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.1
    )
    assert [round(cfg.lr_factor(s), 4) for s in range(7)] == [
        0.5,
        1.0,
        1.0,
        0.775,
        0.55,
        0.325,
        0.1,
    ]


def test_plugin_registers_the_megatron_engines_without_importing_megatron() -> None:
    code = (
        "import sys\n"
        "from hf_core.plugins import get_training_engine, get_rollout_engine, list_backends\n"
        "assert callable(get_training_engine('megatron'))\n"
        "assert callable(get_rollout_engine('megatron'))\n"
        "info = [b for b in list_backends() if b.distribution == 'hf-megatron']\n"
        "assert info and info[0].training_engines == ['megatron'], info\n"
        "assert 'megatron.core' not in sys.modules, 'plugin import pulled in megatron-core'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is off with CUDA")
def test_cpu_compat_maps_cuda_requests_to_cpu_only_inside_the_mode() -> None:
    from hf_megatron import _cpu_compat as cpu_compat

    with cpu_compat.cpu_device_mode():
        made = torch.empty(3, device=torch.cuda.current_device())
        moved = torch.ones(2).cuda()
        assert made.device.type == "cpu" and moved.device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        state = torch.cuda.get_rng_state()
        a = torch.rand(2)
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.rand(2))  # the "CUDA" RNG is the CPU one
    assert torch.ones(1).type() == "torch.FloatTensor"  # nothing leaks outside the mode
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
