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
  followed, and nothing that resolves outside the folder is touched. :func:`find_links`: the
  links among (and under) the entries a run writes, which it refuses to write through.
- :func:`check_loadable`: every file of a checkpoint parses as the data it names (JSON,
  safetensors, tensors only: ``torch.load(weights_only=True)``), or an error naming it.
- :func:`refuse_links`: no write through a link; :func:`read_mapping`, :func:`read_jsonl`: a
  record read back, a damaged one named, a log's last line torn by a crash ignored;
  :func:`append_jsonl`: a record appended to a log (NaN and infinities as null, :func:`json_safe`).
- :func:`data_fingerprint`: what identifies the training data (sizes, times, the SHA-256 of
  each file's first and last blocks), so a resume can tell the data has changed.
- :func:`write_failure`: a failed write (a full disk) as one error naming the folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
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
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover, or a link: never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with open(fd, "w", encoding="utf-8") as f:
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


def find_links(folder, names=lambda name: True) -> list:
    """The symbolic links of ``folder``: each entry whose name ``names`` accepts when it is a
    link, and every link under it when it is a real folder (links are listed, never followed)."""
    folder = Path(folder)
    found = []
    for entry in sorted(folder.iterdir()):
        if not names(entry.name):
            continue
        if entry.is_symlink():
            found.append(entry)
        elif entry.is_dir():
            for root, dirs, leaves in os.walk(entry):  # does not descend into linked folders
                found += sorted(Path(root, n) for n in dirs + leaves if os.path.islink(os.path.join(root, n)))
    return found


def refuse_links(folder, names, remove: bool = False, hint: str = "") -> list:
    """The writer of ``folder`` writes inside it only, never through a link: each link
    :func:`find_links` finds is an OSError naming it (and ``hint``), or with ``remove`` is
    unlinked, its target untouched; returns what was done, as messages."""
    done = []
    for link in find_links(folder, names):
        target = os.readlink(link)
        if not remove:
            raise OSError(f"{link} is a link (to {target}); nothing is written through a link "
                          f"out of {folder}: {hint or 'remove it'}")
        link.unlink()
        done.append(f"removed the link {link} (its target {target} is kept)")
    return done


def read_mapping(path) -> dict:
    """The mapping the JSON or YAML file ``path`` holds; else a :class:`DamagedError` naming it."""
    import yaml   # JSON is YAML

    try:
        value = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise DamagedError(f"{path} is damaged: {err}") from None
    if not isinstance(value, dict):
        raise DamagedError(f"{path} is damaged: a {type(value).__name__}, not a mapping")
    return value


def read_jsonl(path) -> list:
    """The records of the JSON-lines file ``path`` (none when it is missing); a last line a
    crash cut short is ignored, any other line that is not JSON an error naming it."""
    path = Path(path)
    lines = [x for x in path.read_text(encoding="utf-8").split("\n") if x.strip()] if path.is_file() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return records


def json_safe(value):
    """``value`` with every NaN or infinity as None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return [json_safe(v) for v in value] if isinstance(value, (list, tuple)) else value


def append_jsonl(path, record: dict) -> dict:
    """Append ``record`` (made :func:`json_safe`) to the JSON-lines file ``path`` as one line;
    returns it as written."""
    safe = json_safe(record)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(safe, allow_nan=False) + "\n")
    return safe


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
        raise DamagedError(f"{path} is damaged: {type(err).__name__}: {err}") from None
    if not isinstance(files, dict):
        raise DamagedError(f"{path} is damaged: 'files' is a {type(files).__name__}, not a "
                           "mapping of file names to records")
    for name, expected in files.items():
        if not (isinstance(expected, dict) and type(expected.get("bytes")) is int
                and isinstance(expected.get("sha256"), str)):
            raise DamagedError(f"{path} is damaged: the record of {name!r} is {expected!r}, not "
                               "{'bytes': <int>, 'sha256': <hex>}")
        file = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise DamagedError(f"{path} is damaged: it lists {name!r}, which is not a file of {folder}")
        if file.is_symlink():
            raise DamagedError(f"{file} is a link; a checkpoint holds plain files only")
        if not file.is_file():
            raise DamagedError(f"{file} is missing (listed in {path})")
        if file.stat().st_size != expected["bytes"] or sha256(file) != expected["sha256"]:
            raise DamagedError(f"{file} is damaged: its SHA-256 differs from the one in {path}")
    extra = sorted(set(_files(folder)) - set(files))
    if extra:
        raise DamagedError(f"{folder} holds files its manifest does not list: {', '.join(extra)}")
    return True


# Files written by torch.save that nothing loads again (transformers' training arguments,
# a pickle of a whole object): not checked, never loaded.
NOT_LOADED = ("training_args.bin",)


def load_tensors(path: Path):
    """A checkpoint file's tensors, ``torch.load(weights_only=True)`` (mapped where it can)."""
    import warnings

    import torch
    from transformers.trainer_pt_utils import safe_globals   # the numpy types of the random states
    with safe_globals(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on an unusual pickle protocol
        try:  # mapped, not read: an optimizer's state can be large
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # not a zip file


def _reason(err: BaseException) -> str:
    """What ``err`` says is wrong, in one line: for a refused pickle, the global it would
    have loaded (torch's message goes on to explain how to load it anyway: not for a file
    that fails its checks)."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].strip().splitlines()[0].split(". Please")[0]
        return f"not plain tensor data ({text}); nothing of it was run"
    text = " ".join(text.split())
    return f"{type(err).__name__}" + (f": {text[:300]}" if text else "")


def check_loadable(folder, keys: dict | None = None) -> None:
    """Check that each file of ``folder`` parses as what its name says: ``.json`` as JSON,
    ``.safetensors`` by its header, ``.pt``/``.pth``/``.bin`` by ``torch.load`` with
    ``weights_only=True`` (tensors and plain containers: a pickle that would run code, or
    that is cut short, is refused before anything of it runs); a file whose name matches a
    pattern of ``keys`` (``fnmatch``) must hold a mapping with those keys. Raises
    :class:`DamagedError` naming the file and what is wrong."""
    import fnmatch

    folder = Path(folder)
    for name in _files(folder):
        path = folder / name
        suffix = path.suffix
        try:
            if suffix == ".json":
                value = json.loads(path.read_text(encoding="utf-8"))
            elif suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(path), framework="pt") as f:
                    value = dict.fromkeys(f.keys())
            elif suffix in (".pt", ".pth", ".bin") and path.name not in NOT_LOADED:
                value = load_tensors(path)
            else:
                continue
        except Exception as err:  # noqa: BLE001 - whatever the parser says, as one line
            raise DamagedError(f"{path} cannot be loaded: {_reason(err)}") from None
        for pattern, needed in (keys or {}).items():
            if fnmatch.fnmatch(name, pattern):
                missing = [k for k in needed if not isinstance(value, dict) or k not in value]
                if missing:
                    raise DamagedError(f"{path} is damaged: it holds no {', '.join(missing)}")


# ---------------------------------------------------------------------------------------
# The training data's fingerprint

BLOCK = 1 << 20  # the first and last MiB of each file are hashed


def _file_print(path: Path) -> dict:
    stat = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(BLOCK)).hexdigest()
        f.seek(max(stat.st_size - BLOCK, 0))
        tail = hashlib.sha256(f.read(BLOCK)).hexdigest()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": head,
            "tail_sha256": tail}


def data_fingerprint(data, dataset=None) -> dict:
    """What identifies the training data ``data``: a local file, or each file of a local folder
    (hidden ones aside), by size, modification time and the SHA-256 of its first and last
    ``BLOCK`` bytes; a dataset name by the loaded ``dataset``'s own fingerprint."""
    path = Path(data)
    if path.is_file():
        return {"kind": "file", "files": {path.name: _file_print(path)}}
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        return {"kind": "folder", "files": {p.relative_to(path).as_posix(): _file_print(p) for p in found}}
    if dataset is not None:   # the fingerprint of its rows (a loaded one's tells how it was loaded)
        import datasets
        dataset = datasets.Dataset.from_dict(dataset.to_dict())
    return {"kind": "dataset", "dataset": str(data), "fingerprint": getattr(dataset, "_fingerprint", None)}


def fingerprint_changes(data, saved: dict, now: dict) -> list:
    """How the data ``now`` differs from the ``saved`` fingerprint, one phrase per change
    naming the file (empty: the same data)."""
    if "files" not in saved or "files" not in now:
        if saved.get("fingerprint") != now.get("fingerprint"):
            return [f"the dataset {data} has another fingerprint ({saved.get('fingerprint')} "
                    f"at the start, {now.get('fingerprint')} now)"]
        return []
    path = Path(data)
    where = (lambda name: path) if now.get("kind") == "file" else (lambda name: path / name)
    changes = []
    before, after = saved["files"], now["files"]
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            changes.append(f"{where(name)} {'appeared' if old is None else 'is gone'}")
            continue
        what = [w for w, differs in (
            (f"size {old.get('bytes')} -> {new['bytes']} bytes", old.get("bytes") != new["bytes"]),
            ("its first bytes differ", old.get("head_sha256") != new["head_sha256"]),
            ("its last bytes differ", old.get("tail_sha256") != new["tail_sha256"]),
            ("modified since", old.get("mtime_ns") != new["mtime_ns"])) if differs]
        if what:
            changes.append(f"{where(name)} changed ({', '.join(what)})")
    return changes


def write_failure(err: BaseException, folder) -> OSError | None:
    """A failed write into ``folder`` as an :class:`OSError` saying so in one line (a full
    disk by name), or None when ``err`` is not a failed write. torch's zip writer reports a
    failed write as a ``RuntimeError`` without its errno; the folder's free space tells."""
    text = str(err)
    full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left" in text
    failed = full or isinstance(err, OSError) or "file write failed" in text \
        or "PytorchStreamWriter failed" in text
    if not failed:
        return None
    with contextlib.suppress(OSError):
        full = full or shutil.disk_usage(Path(folder).parent).free < BLOCK
    reason = "no space left on device" if full else \
        (text.strip().splitlines() or [type(err).__name__])[0]
    return OSError(f"writing {folder} failed: {reason}")


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
