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
    ``tag_bytes(tag)`` says how many bytes a tag holds, so release and resume report what they
    move -- or, on the CPU where they move nothing, what they would move.  ``cpu_note``
    explains why nothing happens without CUDA (logged once).  ``cpu_release``, when given,
    is what a CPU engine can really free between generations (its KV cache's pages, say): it
    runs on release and returns the bytes it freed; resuming needs nothing.
    """

    def __init__(
        self,
        *,
        on_gpu: bool,
        release: Callable[[Sequence[str]], object],
        resume: Callable[[str], object],
        cpu_note: str,
        tag_bytes: Callable[[str], int] = lambda _tag: 0,
        tags: Sequence[str] = MEMORY_TAGS,
        cpu_release: Callable[[], int] | None = None,
    ) -> None:
        self.on_gpu = on_gpu
        self.tags = tuple(tags)
        self.released: set[str] = set()
        self._release, self._resume = release, resume
        self._tag_bytes = tag_bytes
        self._cpu_note = cpu_note
        self._cpu_release = cpu_release
        self.cpu_freed_bytes = 0
        self._said_cpu_noop = False

    def nbytes(self, tags: Sequence[str] | None = None) -> int:
        """Bytes the given tags (default: all) hold when resident."""
        return sum(self._tag_bytes(tag) for tag in (self.tags if tags is None else tags))

    def release_all(self) -> int:
        """Free every tag; the bytes freed.  On the CPU only ``cpu_release`` frees anything
        (its bytes: :attr:`cpu_freed_bytes`): the state is tracked all the same and the bytes
        a GPU would free are returned."""
        if self.released:
            return 0
        if self._on_gpu("release_memory"):
            self._release(self.tags)
        elif self._cpu_release is not None:
            self.cpu_freed_bytes = self._cpu_release()
        self.released = set(self.tags)
        return self.nbytes()

    def resume(self, tag: str) -> int:
        """Bring back one tag if it is released; the bytes brought back (or that would be)."""
        if tag not in self.released:
            return 0
        if self.on_gpu:
            self._resume(tag)
        self.released.discard(tag)
        return self._tag_bytes(tag)

    def resume_all(self) -> int:
        """Bring back every tag, in order (weights first, then the KV cache); bytes moved
        (on the CPU: a no-op that reports the bytes it would bring back)."""
        self._on_gpu("resume_memory")
        return sum(self.resume(tag) for tag in self.tags)

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
        """Whether weights or KV cache are really released now (only ever on a GPU; the CPU
        tracks what would be released, but nothing is)."""
        return self._memory.on_gpu and bool(self._memory.released)

    def release_memory(self) -> int:
        """GPU: free weights and KV cache. CPU: a no-op (see :attr:`memory_released`) that
        reports the bytes it would free."""
        return self._memory.release_all()

    def resume_memory(self) -> int:
        """Undo :meth:`release_memory` (weights first, then the KV cache); bytes moved."""
        return self._memory.resume_all()
