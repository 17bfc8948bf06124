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
    """A worker process died or stopped answering heartbeats."""

    def __init__(self, role: str, rank: int, method: str, reason: str) -> None:
        self.role, self.rank, self.method, self.reason = role, rank, method, reason
        super().__init__(f"worker lost: role {role!r} rank {rank} during {method!r}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, int, str, str]]:
        return (type(self), (self.role, self.rank, self.method, self.reason))


class GroupBrokenError(RuntimeError):
    """A call on a group that already lost a worker; re-create the group."""
