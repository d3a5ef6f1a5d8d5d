"""Checkpoint files that are never half-written and are refused when damaged.

A checkpoint file is ``MAGIC``, the SHA-256 of the payload, the payload's length (8 bytes,
little endian), then the payload (``torch.save`` of the state). :func:`write_checkpoint`
writes it to a temporary file, fsyncs and renames it into place; :func:`read_checkpoint`
verifies all three before loading. What a training run puts in it is the trainer's
business (:mod:`fastcl.trainer`).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import torch

from .encoders import crash_point, fsync_dir


MAGIC = b"FASTCL-CKPT\x00v2\n"
_HEADER = len(MAGIC) + 32 + 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or fails verification; the message names the file."""


def write_checkpoint(path, state: dict) -> None:
    """Write ``state`` to a temporary file in the same folder with its digest, fsync, then
    ``os.replace``: the checkpoint on disk is always a complete, verifiable one.

    A write killed half-way leaves ``.<name>.tmp-<pid>``; :func:`clean_checkpoint_temps`
    removes it at the next start.
    """
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            half = len(payload) // 2
            f.write(payload[:half])
            f.flush()
            crash_point("checkpoint-write")
            f.write(payload[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        del payload
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def clean_checkpoint_temps(folder, name: str = "checkpoint.pt") -> list:
    """Remove ``.<name>.tmp-<pid>`` files that a killed :func:`write_checkpoint` left behind
    (those of live processes other than this one are kept). Returns the paths removed."""
    removed = []
    for tmp in Path(folder).glob(f".{name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_checkpoint(path) -> dict:
    """The state saved by :func:`write_checkpoint`, after checking its length and SHA-256.

    Raises :class:`CheckpointError` (a ValueError naming the file) for an empty, truncated,
    damaged or foreign file.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"checkpoint {path}: cannot be read ({err.strerror or err})") from err
    if not data:
        raise CheckpointError(f"checkpoint {path} is empty (zero bytes): it is not usable")
    if not data.startswith(MAGIC):
        what = ("it has no integrity digest (written by an older fastcl?)" if data[:2] == b"PK"
                else "it does not start with a fastcl checkpoint header")
        raise CheckpointError(f"checkpoint {path} is not a fastcl checkpoint: {what}")
    if len(data) < _HEADER:
        raise CheckpointError(f"checkpoint {path} is truncated ({len(data)} bytes, shorter "
                              "than its header)")
    digest = data[len(MAGIC):len(MAGIC) + 32]
    size = int.from_bytes(data[len(MAGIC) + 32:_HEADER], "little")
    payload = memoryview(data)[_HEADER:]
    if len(payload) != size:
        raise CheckpointError(f"checkpoint {path} is {'truncated' if len(payload) < size else 'too long'}: "
                              f"{len(payload)} payload bytes, the header says {size}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is damaged: its SHA-256 does not match the "
                              "digest written with it")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:  # verified bytes that still do not load: report, do not trace
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from err

