"""Test only: vLLM's model runner raises once, inside the engine, when a marker file appears.

``tests/e2e/test_engine_death.py`` puts this folder first on the ``PYTHONPATH`` of one run's
processes (and of no other), with ``HF_TEST_VLLM_FAULT`` naming the marker.  Python imports
``sitecustomize`` at start-up in every process of that run; in the one that imports vLLM's model
runner, the runner's ``execute_model`` is wrapped so that the first call after the marker
appears removes it and raises -- a failure in the middle of an engine step, with requests
scheduled, as a kernel or driver error would give.  Removing the marker makes the fault fire
once per run, in one rank.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

MARKER = os.environ.get("HF_TEST_VLLM_FAULT")
TARGET = "vllm.v1.worker.gpu_model_runner"  # the CPU runner inherits execute_model from it


def _patch(module: ModuleType, marker: str) -> None:
    original = module.GPUModelRunner.execute_model

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            os.remove(marker)
        except FileNotFoundError:
            return original(self, *args, **kwargs)
        raise RuntimeError("injected fault inside vLLM's model runner")

    module.GPUModelRunner.execute_model = execute_model


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, marker = spec.loader, self.marker

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _patch(module, marker)

        spec.loader = Loader()
        return spec


if MARKER:
    sys.meta_path.insert(0, _PatchOnImport(MARKER))
