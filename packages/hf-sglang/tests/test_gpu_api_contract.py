"""Every call hf-sglang makes into SGLang and ``torch.cuda``, checked against the installed
SGLang (0.5.23 in this session).

On the CPU the memory saver (``release_memory_occupation`` / ``resume_memory_occupation``,
``enable_memory_saver``) and the nccl weight channel never run, and the engine's GPU keywords
are never passed.  The calls are read from the package's source and bound against SGLang's
signatures, so an SGLang upgrade that renames or drops one fails here instead of on a GPU.
"""

from __future__ import annotations

from pathlib import Path

from hf_sglang.config import SGLangRolloutConfig
from hf_sglang.engine import engine_kwargs
from hf_testing.api_contract import ApiCall, assert_accepted, calls_in, forwarded, resolve

ENGINE = "sglang.srt.entrypoints.engine.Engine"
"""The class behind ``sglang.Engine`` (a lazy-import proxy whose own signature says nothing)."""
SELF_ENGINE = {"self.engine.": f"{ENGINE}.", "torch.cuda.": "torch.cuda."}
SOURCES = {
    "hf_sglang.engine": {**SELF_ENGINE, "engine.": f"{ENGINE}."},
    "hf_sglang.weights": {
        **SELF_ENGINE,
        "init_custom_process_group": "sglang.srt.utils.init_custom_process_group",
        "torch.distributed.": "torch.distributed.",
    },
}
FORWARDS = {ENGINE: f"{ENGINE}.server_args_class"}
"""``Engine(**kwargs)`` builds its ``server_args_class`` (``ServerArgs``) from them."""
GPU_ONLY = {
    f"{ENGINE}.release_memory_occupation",
    f"{ENGINE}.resume_memory_occupation",
    f"{ENGINE}.init_weights_update_group",
    f"{ENGINE}.update_weights_from_distributed",
    "sglang.srt.utils.init_custom_process_group",
    "torch.cuda.current_device",
}
"""Calls the scan must find: a refactor that hides them from it fails here, not silently."""


def test_sglang_engine_is_the_class_checked() -> None:
    _, public = resolve("sglang.Engine")
    _, engine = resolve(ENGINE)
    assert public.release_memory_occupation is engine.release_memory_occupation


def test_the_scan_finds_the_gpu_only_calls() -> None:
    found = {call.target for module, names in SOURCES.items() for call in calls_in(module, names)}
    assert found >= GPU_ONLY


def test_sglang_accepts_every_call(tmp_path: Path) -> None:
    calls = [call for module, names in SOURCES.items() for call in calls_in(module, names)]
    cfg = SGLangRolloutConfig(
        model_path=tmp_path,
        attention_backend="flashinfer",
        mem_fraction_static=0.5,
        max_total_tokens=4096,
        max_running_requests=8,
        context_length=512,
    )
    keywords = tuple(engine_kwargs(cfg, "cuda"))
    assert "enable_memory_saver" in keywords
    calls.append(ApiCall(ENGINE, kwargs=keywords, site="hf_sglang/engine.py: engine_kwargs(cuda)"))
    findings = assert_accepted(forwarded(calls, FORWARDS))
    by_signature = {f.call.target for f in findings if f.by_signature}
    assert by_signature >= GPU_ONLY | set(FORWARDS.values())
