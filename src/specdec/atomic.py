"""Crash-safe writes: every file specdec writes goes to a temporary name, is fsynced, then renamed.

A kill at any moment leaves either the old file or the new one, never a torn one. JSONL appends
write whole lines and fsync, so a reader only ever has to drop an unterminated last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import IO, Iterator


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it and rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            # Mode 0o666 less the umask, as open() gives: tempfile.mkstemp's 0o600 would leave an
            # exported drafter unreadable by a server running as another user.
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            continue
    if path.exists():  # a rewrite keeps the file's mode
        os.chmod(tmp, path.stat().st_mode & 0o7777)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def append_jsonl(f: IO[str], record: dict) -> None:
    """Append one record as one line and make it durable before returning."""
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read complete records; a torn last line (killed mid-write) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return records


def repair_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read complete records and truncate the file to them, so appends continue cleanly."""
    records = read_jsonl(path)
    path = Path(path)
    if path.exists():
        good = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if path.read_text(encoding="utf-8") != good:
            with atomic_open(path) as f:
                f.write(good)
    return records
