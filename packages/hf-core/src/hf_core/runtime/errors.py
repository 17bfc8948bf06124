"""Errors the controller raises for failures inside worker groups."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised; carries role, rank, method and the remote traceback."""

    def __init__(
        self, role: str, rank: int, method: str, exc_type: str, message: str, remote_tb: str
    ) -> None:
        self.role, self.rank, self.method = role, rank, method
        self.exc_type, self.message, self.remote_traceback = exc_type, message, remote_tb
        super().__init__(
            f"{exc_type} in role {role!r} rank {rank} method {method!r}: {message}\n"
            f"--- remote traceback (role {role!r}, rank {rank}) ---\n{remote_tb}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int, str, str, str, str]]:
        args = (self.role, self.rank, self.method, self.exc_type, self.message)
        return (type(self), (*args, self.remote_traceback))


class WorkerLostError(RuntimeError):
    """A worker process died or stopped answering heartbeats.

    Unlike :class:`WorkerError` (a Python exception raised by worker code, which would be
    raised again by the same code), this is an infrastructure fault: the trainer's
    self-healing restarts the groups on it.  ``stacks_dir`` is the folder holding every
    rank's Python stacks dumped when the loss was detected (``None``: not dumped).
    """

    def __init__(
        self,
        role: str,
        rank: int,
        method: str,
        reason: str,
        stacks_dir: str | None = None,
        out_of_memory: bool = False,
    ) -> None:
        self.role, self.rank, self.method, self.reason = role, rank, method, reason
        self.stacks_dir = stacks_dir
        self.out_of_memory = out_of_memory
        """The kernel's out-of-memory killer ended the process (the same step would again)."""
        where = f"; every rank's Python stacks are in {stacks_dir}" if stacks_dir else ""
        super().__init__(
            f"worker lost: role {role!r} rank {rank} during {method!r}: {reason}{where}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int, str, str, str | None, bool]]:
        args = (self.role, self.rank, self.method, self.reason, self.stacks_dir)
        return (type(self), (*args, self.out_of_memory))


class GroupBrokenError(RuntimeError):
    """A call on a group that already lost a worker; re-create the group."""
