"""Import hook serving test-only stand-ins for modules SGLang's CPU path needs (see README.md).

Installed at interpreter start-up by the ``.pth`` file ``install.py`` writes; it must stay cheap
(no torch / transformers import here).  A stand-in is served only when the real module is not
installed, so the hook is inert where the real ``sgl_kernel`` / ``torchvision`` exist.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

STUBS = Path(__file__).resolve().parent / "stubs"
STAND_INS = ("sgl_kernel", "torchvision")
TRANSFORMERS_IMPORT_UTILS = "transformers.utils.import_utils"


class _HarnessFinder(importlib.abc.MetaPathFinder):
    """Serves ``stubs/<name>`` for the stand-in packages when nothing else provides them."""

    def __init__(self) -> None:
        self.hidden = False
        self._real: dict[str, bool] = {}

    def _really_installed(self, top: str) -> bool:
        if top not in self._real:
            self._real[top] = importlib.machinery.PathFinder.find_spec(top) is not None
        return self._real[top]

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if fullname == TRANSFORMERS_IMPORT_UTILS:
            return self._wrap_transformers(fullname, path, target)
        if top not in STAND_INS or self.hidden or self._really_installed(top):
            return None
        search = [str(STUBS)] if path is None else path
        return importlib.machinery.PathFinder.find_spec(fullname, search, target)

    def _wrap_transformers(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        """Let transformers cache ``is_torchvision_available() == False`` while hidden."""
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        finder, real_exec = self, spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            if finder._really_installed("torchvision"):
                return
            finder.hidden = True
            try:
                module.is_torchvision_available()  # lru-cached: False from now on
                module.is_torchvision_v2_available()
            finally:
                finder.hidden = False

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _HarnessFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def active_stand_ins() -> list[str]:
    """Which stand-ins this interpreter would serve (for test reports)."""
    return [name for name in STAND_INS if not _FINDER._really_installed(name)]


__all__ = ["active_stand_ins", "install"]
