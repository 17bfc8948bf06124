"""The GPU-API checker: it passes a matching library and fails one whose signature changed.

A fake library (a module put into ``sys.modules``) plays vLLM before and after an upgrade, so
each way a version bump can break a call -- an argument renamed, a required one added, a
function removed, a keyword that only ``**kwargs`` swallows -- is shown to fail with a message
that names the call site.
"""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_testing.api_contract import ApiCall, assert_accepted, calls_in, check, check_calls

SLEEP = ApiCall("fakelib.LLM.sleep", kwargs=("level",), site="hf_fake/engine.py:10")
WAKE = ApiCall("fakelib.LLM.wake_up", kwargs=("tags",), site="hf_fake/engine.py:11")


def _library(**members: Any) -> Callable[[pytest.MonkeyPatch], None]:
    def install(monkeypatch: pytest.MonkeyPatch) -> None:
        module = types.ModuleType("fakelib")
        module.__dict__.update(members)
        monkeypatch.setitem(sys.modules, "fakelib", module)

    return install


class _Released:
    """What the library looks like at the version the code was written for."""

    def __init__(self, model: str, **kwargs: Any) -> None: ...
    def sleep(self, level: int = 1) -> None: ...
    def wake_up(self, tags: list[str] | None = None) -> None: ...
    @staticmethod
    def build(path: str) -> None: ...
    @classmethod
    def create(cls, path: str) -> None: ...


class _Upgraded:
    """The same library after an upgrade that breaks every call above."""

    def sleep(self, mode: int = 1) -> None: ...  # ``level`` renamed
    def wake_up(self, tags: list[str], *, force: bool) -> None: ...  # a required keyword added


def test_matching_signatures_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    _library(LLM=_Released)(monkeypatch)
    findings = assert_accepted(
        [
            SLEEP,
            WAKE,
            ApiCall("fakelib.LLM.sleep", args=1),  # positional, after self
            ApiCall("fakelib.LLM", args=1),  # the constructor
            ApiCall("fakelib.LLM", kwargs=("model", "seed"), forwards_kwargs=True),
            ApiCall("fakelib.LLM.build", args=1),  # no self for a staticmethod ...
            ApiCall("fakelib.LLM.create", kwargs=("path",)),  # ... nor a classmethod
        ]
    )
    assert all(finding.by_signature for finding in findings)


def test_renamed_argument_fails_naming_the_site(monkeypatch: pytest.MonkeyPatch) -> None:
    _library(LLM=_Upgraded)(monkeypatch)
    problem = check(SLEEP).problem
    assert problem is not None
    assert problem.startswith("hf_fake/engine.py:10: fakelib.LLM.sleep(level=)")
    assert "unexpected keyword argument 'level'" in problem


def test_added_required_argument_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _library(LLM=_Upgraded)(monkeypatch)
    problem = check(WAKE).problem
    assert problem is not None and "missing a required argument: 'force'" in problem


def test_missing_function_class_or_module_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _library(LLM=_Upgraded)(monkeypatch)
    assert "fakelib.LLM has no attribute 'reset'" in str(check(ApiCall("fakelib.LLM.reset")))
    assert "fakelib has no attribute 'Engine'" in str(check(ApiCall("fakelib.Engine.sleep")))
    assert "no module 'notalib' is installed" in str(check(ApiCall("notalib.f")).problem)
    with pytest.raises(AssertionError, match=r"(?s)do not accept.*hf_fake/engine.py:10.*:11"):
        assert_accepted([SLEEP, WAKE])


def test_keyword_only_swallowed_by_var_kwargs_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM(seed=...)`` binds to ``**kwargs`` whatever the library calls it now: that proves
    nothing unless the call says the keywords are forwarded (and where is checked too)."""
    _library(LLM=_Released)(monkeypatch)
    problem = check(ApiCall("fakelib.LLM", kwargs=("model", "seed"))).problem
    assert problem is not None and "takes ['seed'] only through **kwargs" in problem


def test_partial_call_checks_only_what_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _library(LLM=_Upgraded)(monkeypatch)
    assert check(ApiCall("fakelib.LLM.wake_up", partial=True)).problem is None
    assert check(ApiCall("fakelib.LLM.wake_up", kwargs=("tags",), partial=True)).problem is None
    assert check(ApiCall("fakelib.LLM.wake_up", kwargs=("tag",), partial=True)).problem


def test_c_function_without_signature_is_checked_for_existence() -> None:
    (copy,) = check_calls([ApiCall("torch.Tensor.copy_", args=1, kwargs=("non_blocking",))])
    assert copy.problem is None and not copy.by_signature
    assert "has no attribute 'copy'" in str(check(ApiCall("torch.Tensor.copy")).problem)


def _stand_in(*args: Any, **kwargs: Any) -> None:
    """A project's CPU stand-in for a CUDA function (accepts anything)."""


_stand_in.__module__ = "hf_fake._cpu_compat"


def test_patched_function_is_reported_and_checked_in_a_fresh_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stand-in the project installed would accept any arguments: it is reported instead of
    checked, and a fresh interpreter checks the library's own function."""
    monkeypatch.setattr(torch.cuda, "synchronize", _stand_in)
    calls = [ApiCall("torch.cuda.synchronize", args=1), ApiCall("torch.cuda.synchronize", args=2)]
    assert "patched it with hf_fake._cpu_compat._stand_in" in str(check(calls[0]).problem)
    fresh = check_calls(calls, fresh_process=True)
    assert fresh[0].problem is None and fresh[0].by_signature
    assert "too many positional arguments" in str(fresh[1].problem)


def test_calls_are_read_from_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "hf_fake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Engine:
                def release(self, tag, options):
                    self.llm.sleep(level=1)
                    self.llm.wake_up(tags=[tag])
                    self.llm.llm_engine.shutdown()  # a longer chain: not this receiver
                    run(self.llm.reset_prefix_cache)  # passed on uncalled
                    self.llm.generate(*tag, **options)
                    torch.cuda.synchronize(self.device)
                    other.sleep(level=2)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = calls_in("hf_fake.engine", {"self.llm.": "fakelib.LLM.", "torch.cuda.": "torch.cuda."})
    assert found == [
        ApiCall("fakelib.LLM.sleep", kwargs=("level",), site="hf_fake/engine.py:6"),
        ApiCall("fakelib.LLM.wake_up", kwargs=("tags",), site="hf_fake/engine.py:7"),
        ApiCall("fakelib.LLM.reset_prefix_cache", site="hf_fake/engine.py:9", partial=True),
        ApiCall("fakelib.LLM.generate", site="hf_fake/engine.py:10", partial=True),
        ApiCall("torch.cuda.synchronize", args=1, site="hf_fake/engine.py:11"),
    ]
    _library(LLM=_Released)(monkeypatch)
    problems = [f.problem for f in check_calls(found) if f.problem]
    assert problems == [
        "hf_fake/engine.py:9: fakelib.LLM.reset_prefix_cache(...): "
        "fakelib.LLM has no attribute 'reset_prefix_cache'",
        "hf_fake/engine.py:10: fakelib.LLM.generate(...): fakelib.LLM has no attribute 'generate'",
    ]


def test_gpu_test_helpers_calls_into_torch() -> None:
    """hf_testing.gpu's own CUDA calls (it runs only on a GPU)."""
    calls = calls_in(
        "hf_testing.gpu", {"torch.cuda.": "torch.cuda.", "dist.": "torch.distributed."}
    )
    assert {"torch.cuda.set_device", "torch.cuda.memory_allocated"} <= {c.target for c in calls}
    assert_accepted(calls)
