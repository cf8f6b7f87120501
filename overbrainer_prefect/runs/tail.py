"""Tailing a file on a target: read from an offset, keep what is not a whole
line yet, never read the same byte twice."""

from __future__ import annotations

from overbrainer_prefect.executors.base import MAX_TAIL_READ, Executor


class LineStream:
    """The complete lines appended to `path` on the target since the last read."""

    def __init__(self, executor: Executor, path: str, offset: int = 0) -> None:
        self.executor = executor
        self.path = path
        self.offset = offset
        self._partial = b""

    async def read(self) -> list[str]:
        """The complete lines added since the last call (at most `MAX_TAIL_READ`
        bytes are fetched; a longer backlog needs several calls). Raises ExecError
        when the target cannot be read; the offset then stays where it was."""
        data = await self.executor.read_from(self.path, self.offset, MAX_TAIL_READ)
        if not data:
            return []
        self.offset += len(data)
        buffer = self._partial + data
        *complete, self._partial = buffer.split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete if line.strip()]
