"""The one error type of ``shardwise.checkpoint``."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit the model: missing, incomplete,
    truncated, corrupted, or saved from another model. The message names the checkpoint, the
    file and, where one is concerned, the tensor.

    Attributes:
        path: the checkpoint folder.
        file: the file at fault (relative to ``path``), or None.
        tensor: the tensor at fault, or None.
    """

    def __init__(self, message: str, path: object = None, file: str | None = None,
                 tensor: str | None = None) -> None:
        super().__init__(message)
        self.path, self.file, self.tensor = path, file, tensor
