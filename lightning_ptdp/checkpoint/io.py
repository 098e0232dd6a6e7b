"""Full-format checkpoint files written atomically: a crash never leaves a partial file under
the real name, and a cut file is reported as one when read."""

from __future__ import annotations

import os
import pickle
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

_CUT_FILE = ("PytorchStreamReader", "zip archive", "central directory", "unexpected EOF")


def fsync_dir(folder: str) -> None:
    """Sync a directory's entries (a rename into it); some filesystems cannot, which is fine."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class CheckedCheckpointIO(TorchCheckpointIO):
    """Torch checkpoint files written so that a crash never leaves a partial file under the real
    name, and read with an error that says so when a file is not a complete checkpoint.

    A local file is written to ``.<name>.partial`` in the same directory, flushed to disk, then
    renamed over the target (atomic on POSIX); the rename and the directory entry are synced.
    Lightning's own writer stages through the system temp directory and moves the file, which is a
    copy (not atomic) when that is another filesystem. Remote paths keep Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        target = os.path.abspath(str(path))
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, f".{os.path.basename(target)}.partial")
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, target)
        except BaseException:
            if os.path.exists(partial):
                os.remove(partial)
            raise
        fsync_dir(folder)  # make the rename itself durable

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        kwargs = {} if map_location is None else {"map_location": map_location}
        try:
            return super().load_checkpoint(path, weights_only=weights_only, **kwargs)
        except (EOFError, pickle.UnpicklingError, RuntimeError) as error:  # how torch reports a cut file
            if isinstance(error, RuntimeError) and not any(s in str(error) for s in _CUT_FILE):
                raise
            size = os.path.getsize(path) if os.path.exists(path) else 0
            raise ValueError(
                f"checkpoint {str(path)!r} ({size} bytes) is truncated or not a torch checkpoint ({type(error).__name__}: "
                f"{error}); it was not written completely. Resume from an earlier checkpoint"
            ) from error
