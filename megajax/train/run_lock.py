"""One run per run directory: `<run_dir>/run.lock`, held while a run uses the directory.

The lock is an advisory `flock` on that file, taken by process 0 (the process
that writes metrics, TensorBoard events and checkpoint metadata). The kernel
drops it when its holder exits however it exits (kill -9 included), so a lock
whose holder is gone is simply taken again; the file's text (host, PID, start
time, command) names the holder for the refusal message, and a text left by a
holder that never released it is reported as taken over. The file is kept
between runs (emptied on release) so two runs can never lock two different
files of the same name.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from megajax.errors import UserError

LOCK_NAME = "run.lock"


class RunDirInUse(UserError):
    """Another run holds the run directory."""


def _holder_text(info: dict) -> str:
    since = info.get("since", "?")
    return f"host {info.get('host', '?')}, PID {info.get('pid', '?')}, since {since}"


class RunDirLock:
    """Held from before a run reads its directory until the run has written its last line.

    `acquire()` raises RunDirInUse (naming the holder) when another live run holds the
    directory, and returns a note (or None) when it took over a lock its holder never released.
    `release()` also removes the directory it created when nothing else was written there."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # directories acquire() made, deepest first

    def acquire(self) -> str | None:
        absolute = self.run_dir.absolute()
        self._created = [d for d in (absolute, *absolute.parents) if not d.exists()]
        while True:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise self._unusable(e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                info = self._read(fd)
                os.close(fd)
                raise self._in_use(info) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the file was removed between open and lock: lock the one there now
        previous = self._read(fd)
        self._fd = fd
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": now,
                "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        if previous:
            return (f"megajax: note: took over {self.path}: its holder ({_holder_text(previous)}) ended "
                    f"without releasing it (killed or crashed); no other run uses the directory now.")
        return None

    def _unusable(self, e: OSError) -> UserError:
        """The run directory cannot be made or written: a file there or on its path, a read-only place."""
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            where = next((p for p in (self.run_dir, *self.run_dir.parents) if p.exists() and not p.is_dir()),
                         self.run_dir)
            why = ("it is a file, not a directory" if where == self.run_dir else
                   f"{str(where)!r} is a file, where a directory of the path belongs")
        else:
            why = f"{e.strerror or e} ({e.filename})" if e.filename else str(e.strerror or e)
        return UserError(f"train.run_dir {str(self.run_dir)!r}: cannot use it as the run directory: {why}. "
                         f"Set train.run_dir to a directory this user can write (it is made if missing).")

    def _in_use(self, info: dict) -> RunDirInUse:
        command = f"; command: {info['command']}" if info.get("command") else ""
        return RunDirInUse(
            f"train.run_dir {str(self.run_dir)!r} is in use by another run ({_holder_text(info)}{command}): "
            f"two runs in one directory would interleave their metrics and checkpoints. Wait for it to "
            f"finish, stop it, or choose another train.run_dir.")

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            text = os.pread(fd, 65536, 0).decode(errors="replace").strip()
            return json.loads(text) if text else {}
        except (OSError, ValueError):
            return {"host": "?", "pid": "?", "since": "? (unreadable lock file)"}

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # drops the flock
        if self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]:
            # A start-up that failed before writing anything leaves no directory behind.
            try:
                self.path.unlink()
                for d in self._created:
                    d.rmdir()
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
