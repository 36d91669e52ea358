"""One run at a time in a run folder: an exclusive lock on `<dump_folder>/run.lock`.

Two runs in one folder would interleave metrics.jsonl, resume from each other's checkpoints and remove each
other's staging folders. The lock is an OS file lock (fcntl), held by rank 0 for the life of the process, so a run
that is killed, even with SIGKILL, leaves no stale lock behind; the file records who holds it, for the message.
"""

import fcntl
import os
import socket
import time
from pathlib import Path

from torchtitan.tools.utils import rank0_error

LOCK_NAME = "run.lock"


class RunFolderError(RuntimeError):
    """The run folder cannot be used by this run; the message names it (what the ranks other than 0 raise)."""


class RunFolderLockedError(RunFolderError):
    """Another run holds the run folder; the message names it."""


class RunFolderNotWritableError(RunFolderError):
    """The run folder cannot be created or written (read-only, or a file in its path); the message names it."""


class RunLock:
    """The held lock of one run folder; `release()` (or process exit) frees it."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK_NAME
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a+")  # noqa: SIM115 (held open for the life of the run)
        except OSError as e:  # the run's first write: OSError's own text names no config key
            raise RunFolderNotWritableError(
                f"job.dump_folder {folder} is not writable ({e.strerror or e}: {e.filename or self.path}); a run "
                "writes its metrics and checkpoints there: give it a writable --job.dump_folder"
            ) from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RunFolderLockedError(
                f"job.dump_folder {folder} is in use by another run ({holder}); two runs in one folder would mix "
                "their metrics and checkpoints: wait for it to end, or give this run another --job.dump_folder"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def acquire_run_lock(folder: Path, rank: int) -> RunLock | None:
    """Rank 0 takes the folder's lock; it raises RunFolderLockedError if the lock is held elsewhere, or
    RunFolderNotWritableError if it cannot write there, and every other rank a RunFolderError of the same message."""
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = RunLock(folder)
        except RunFolderError as e:
            refusal = e
    error = rank0_error(str(refusal) if refusal else "")
    if error:
        raise refusal if refusal is not None else RunFolderError(error)
    return lock
