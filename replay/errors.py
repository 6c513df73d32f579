"""Errors about input files: every one names the file, the line (or key) and the reason."""

from __future__ import annotations


class InputFileError(Exception):
    """A problem in a cluster, trace or health file, as one line a person can act on.

    ``where`` is a line number (int) or a key path (``budget.llm.weight``);
    ``str(err)`` is ``"file:line: reason"`` or ``"file: key: reason"``.
    """

    def __init__(self, file: str, where: int | str | None, reason: str) -> None:
        self.file = str(file)
        self.where = where
        self.reason = reason
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.where is None:
            return f"{self.file}: {self.reason}"
        if isinstance(self.where, int):
            return f"{self.file}:{self.where}: {self.reason}"
        return f"{self.file}: {self.where}: {self.reason}"


TraceError = InputFileError
"""Alias: the same error for trace and health CSVs."""
