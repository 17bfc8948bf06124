"""Releasing a rollout engine's device memory while the training engine runs.

vLLM (sleep mode) and SGLang (memory saver) can hand back the memory of their weights and KV
cache between generations, each under tags (``weights``, ``kv_cache``), and only on a GPU.
:class:`TaggedMemory` keeps the bookkeeping both need: which tags are released, waking them
one at a time (weights before a weight sync, all before generating), and saying once that
the calls are no-ops on the CPU instead of failing there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")


class TaggedMemory:
    """Which of an engine's memory tags are released now; the engine supplies the calls.

    ``release(tags)`` frees all of them at once; ``resume(tag)`` brings one back.
    ``cpu_note`` explains why nothing happens without CUDA (logged once).
    """

    def __init__(
        self,
        *,
        on_gpu: bool,
        release: Callable[[Sequence[str]], object],
        resume: Callable[[str], object],
        cpu_note: str,
        tags: Sequence[str] = MEMORY_TAGS,
    ) -> None:
        self.on_gpu = on_gpu
        self.tags = tuple(tags)
        self.released: set[str] = set()
        self._release, self._resume = release, resume
        self._cpu_note = cpu_note
        self._said_cpu_noop = False

    def release_all(self) -> None:
        """Free every tag (a no-op on the CPU, or when already released)."""
        if not self._on_gpu("release_memory"):
            return
        if not self.released:
            self._release(self.tags)
            self.released = set(self.tags)

    def resume(self, tag: str) -> None:
        """Bring back one tag if it is released."""
        if tag in self.released:
            self._resume(tag)
            self.released.discard(tag)

    def resume_all(self) -> None:
        """Bring back every tag, in order (weights first, then the KV cache)."""
        if not self._on_gpu("resume_memory"):
            return
        for tag in self.tags:
            self.resume(tag)

    def _on_gpu(self, what: str) -> bool:
        if not self.on_gpu and not self._said_cpu_noop:
            log.info("%s is a no-op on CPU: %s", what, self._cpu_note)
            self._said_cpu_noop = True
        return self.on_gpu


class ReleasesTaggedMemory:
    """Mixin for a rollout engine whose ``_memory`` is a :class:`TaggedMemory`: the
    interface's ``release_memory`` / ``resume_memory`` and :attr:`memory_released`."""

    _memory: TaggedMemory

    @property
    def memory_released(self) -> bool:
        """Whether weights or KV cache are released now (only ever on a GPU)."""
        return bool(self._memory.released)

    def release_memory(self) -> None:
        """GPU: free weights and KV cache. CPU: a no-op (see :attr:`memory_released`)."""
        self._memory.release_all()

    def resume_memory(self) -> None:
        """Undo :meth:`release_memory` (weights first, then the KV cache)."""
        self._memory.resume_all()
