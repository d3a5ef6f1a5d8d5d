"""Durable files for the trainer: writes a crash cannot tear, folders swapped in whole, a
checkpoint's digest, one run per output folder, and removal that never leaves that folder.

- :func:`replace_text`: a file written through a temporary file, fsync and ``os.replace``;
  a crash or a power loss leaves the previous version or the new one.
- :func:`swap_in`: a staged folder put in place of another (the old one renamed aside first,
  removed last); :func:`recover_swaps` finishes or undoes a swap a crash interrupted.
- :func:`write_manifest` / :func:`verify_manifest`: the SHA-256 of every file of a folder,
  written last, so a folder without one is incomplete and one that fails it is damaged.
- :class:`OutputLock`: an exclusive ``flock`` on ``<folder>/.fastcl.lock`` holding the pid;
  the kernel drops it when its process dies, so a killed run's lock is taken over.
- :func:`remove_inside`: removes an entry of a folder; a symbolic link is unlinked, never
  followed, and nothing that resolves outside the folder is touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
from pathlib import Path

MANIFEST = "fastcl_manifest.json"
LOCK = ".fastcl.lock"
_OLD = ".old-"     # a swapped-out folder awaiting removal: .old-<name>
_STAGE = ".stage-"  # a folder being written: .stage-<name>-<pid>


def crash_point(name: str) -> None:
    """Test hook: ``FASTCL_CRASH_AT=NAME[:N]`` makes the process SIGKILL itself the N-th time
    (default the first) it reaches the write point ``NAME``. For fault-injection tests."""
    spec = os.environ.get("FASTCL_CRASH_AT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    counts = crash_point.__dict__.setdefault("counts", {})
    counts[name] = counts.get(name, 0) + 1
    if counts[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(folder) -> None:
    """Make a rename or a new entry in ``folder`` durable (best effort: not every file system
    lets a folder be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(folder) -> None:
    """Flush every file under ``folder``, and the folders themselves, to disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def replace_text(path, text: str) -> None:
    """Write ``text`` to ``path`` through ``.<name>.tmp``, fsync and ``os.replace``, then
    fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def is_inside(path, folder) -> bool:
    """Whether ``path``, its links resolved, lies inside ``folder`` (itself excluded)."""
    real, base = os.path.realpath(path), os.path.realpath(folder)
    return real != base and os.path.commonpath([real, base]) == base


def remove_inside(path, folder) -> None:
    """Remove the entry ``path`` of ``folder``: a link is unlinked (its target stays), a file
    removed, a folder removed with its content when it really lies inside ``folder``. Refuses
    anything else, naming it."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif not path.exists():
        return
    elif not is_inside(path, folder):
        raise OSError(f"refusing to remove {path}: it lies outside {folder}")
    elif path.is_dir():
        # rmtree never follows a link inside the tree: it removes the link itself
        shutil.rmtree(path)
    else:
        path.unlink()


def stage_dir(target) -> Path:
    """A fresh staging folder beside ``target`` (same file system, so the swap is a rename)."""
    target = Path(target)
    stage = target.with_name(f"{_STAGE}{target.name}-{os.getpid()}")
    if stage.exists() or stage.is_symlink():
        remove_inside(stage, target.parent)
    stage.mkdir(parents=True)
    return stage


def swap_in(stage, target) -> None:
    """Put the complete folder ``stage`` in place of ``target``: a reader sees the old folder or
    the new one, never a mix. ``target`` is renamed aside first (a real folder) or unlinked (a
    link: its target is never touched), ``stage`` renamed to it, the old one removed last."""
    stage, target = Path(stage), Path(target)
    parent = target.parent
    fsync_tree(stage)
    old = parent / f"{_OLD}{target.name}"
    if old.exists() or old.is_symlink():
        remove_inside(old, parent)
    if target.is_symlink():
        target.unlink()
    elif target.exists():
        os.rename(target, old)
        fsync_dir(parent)
    crash_point("swap")
    os.rename(stage, target)
    fsync_dir(parent)
    if old.exists():
        remove_inside(old, parent)


def recover_swaps(folder) -> list:
    """Finish what an interrupted :func:`swap_in` or staging left in ``folder``: a staging
    folder is removed; a swapped-out folder comes back when its successor is missing, else is
    removed. Returns what was done, as messages."""
    folder = Path(folder)
    done = []
    for entry in sorted(folder.glob(".*")):
        if entry.name.startswith(_STAGE):
            remove_inside(entry, folder)
            done.append(f"removed {entry}, an interrupted write")
        elif entry.name.startswith(_OLD):
            target = folder / entry.name[len(_OLD):]
            if target.exists():
                remove_inside(entry, folder)
                done.append(f"removed {entry}, replaced by {target.name}")
            elif entry.is_dir() and not entry.is_symlink():
                os.rename(entry, target)
                done.append(f"restored {target} from {entry.name} (its replacement was not finished)")
    if done:
        fsync_dir(folder)
    return done


# ---------------------------------------------------------------------------------------
# Manifests: what a complete folder holds

def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(folder) -> Path:
    """Write ``folder/MANIFEST``: the size and SHA-256 of every file in ``folder``, after they
    are flushed to disk. Written last, it marks the folder complete."""
    folder = Path(folder)
    fsync_tree(folder)
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
             for name in _files(folder)}
    replace_text(folder / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1) + "\n")
    return folder / MANIFEST


class DamagedError(ValueError):
    """A folder whose files do not match its manifest."""


def verify_manifest(folder) -> bool:
    """True when ``folder`` has a manifest and every file in it matches; False when it has
    none (an incomplete write); raises :class:`DamagedError`, naming the file, otherwise."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise DamagedError(f"{path} is damaged: {err}") from None
    for name, expected in files.items():
        file = folder / name
        if not file.is_file():
            raise DamagedError(f"{file} is missing (listed in {path})")
        if file.stat().st_size != expected["bytes"] or sha256(file) != expected["sha256"]:
            raise DamagedError(f"{file} is damaged: its SHA-256 differs from the one in {path}")
    extra = sorted(set(_files(folder)) - set(files))
    if extra:
        raise DamagedError(f"{folder} holds files its manifest does not list: {', '.join(extra)}")
    return True


# ---------------------------------------------------------------------------------------
# One run per output folder

class LockedError(RuntimeError):
    """The output folder is in use by another run."""


class OutputLock:
    """An exclusive lock on ``folder`` for the life of this process (or until :meth:`release`):
    ``flock`` on ``folder/LOCK``, which holds the holder's pid and host. A second run is
    refused naming them; a lock file left by a killed run holds no lock and is taken over."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK
        self.fd = None
        self.previous = None   # the holder a stale lock file named, when taken over

    def acquire(self) -> "OutputLock":
        import fcntl

        if self.path.is_symlink():
            self.path.unlink()  # never lock (or write) through a link
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise LockedError(f"{self.path.parent} is in use by another run (lock {self.path}, "
                              f"held by {holder}); wait for it to finish or choose another "
                              "folder") from None
        self.previous = os.read(fd, 4096).decode("utf-8", "replace").strip() or None
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
