"""Run a test as if a library were not installed: what an optional extra's "install me"
error is checked with."""

from __future__ import annotations

import builtins
import sys
from typing import Any

import pytest


def pretend_missing(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``import <package>`` (and its submodules) fail for the rest of the test, its
    already-imported modules forgotten; monkeypatch undoes both."""
    real_import = builtins.__import__

    def refuse(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == package:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    for name in [m for m in sys.modules if m.split(".")[0] == package]:
        monkeypatch.delitem(sys.modules, name)
