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


def plain_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask. A 0600 file (tempfile's, or the one
    safetensors writes) would leave an exported drafter unreadable by a server running as another user."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it and rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            break
        except FileExistsError:
            continue
    mode = path.stat().st_mode & 0o7777 if path.exists() else None  # a rewrite keeps the file's mode
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # Set after the write: writers such as safetensors replace the file with a 0600 one of their own.
        os.chmod(tmp, plain_mode() if mode is None else mode)
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


def jsonl_values(path: str | os.PathLike, *, torn_ok: bool = True) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSONL file, read line by line (a
    capture's index or a prompt set can be large). A line that is not JSON in UTF-8 is an error
    naming the file and line; with `torn_ok` (files specdec appends to), the last line when it
    has no newline, the one a kill can tear, is skipped with a note instead."""
    from .errors import SpecdecError

    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            torn = torn_ok and not raw.endswith(b"\n")  # only the last line can lack its newline
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                if torn:
                    _torn(Path(path), n)
                    return
                raise SpecdecError(f"{path}, line {n}: not valid UTF-8 (byte {e.start + 1}); fix or delete that "
                                   f"line, then rerun") from None
            except ValueError as e:  # JSONDecodeError, or an integer too long to convert
                if torn:
                    _torn(Path(path), n)
                    return
                raise SpecdecError(f"{path}, line {n}: not valid JSON ({e}); expected one JSON object per line: "
                                   f"fix or delete that line, then rerun") from None
            yield n, value


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every record of a JSONL file specdec appends to (`jsonl_values`: a torn last line is
    dropped, any other broken line is an error); a line that is not an object is an error too."""
    from .errors import SpecdecError

    if not Path(path).exists():
        return []
    records = []
    for n, record in jsonl_values(path):
        if not isinstance(record, dict):
            raise SpecdecError(f"{path}, line {n}: a JSON {type(record).__name__}, expected an object")
        records.append(record)
    return records


def _torn(path: Path, n: int) -> None:
    import sys

    print(f"specdec: note: {path}, line {n}: incomplete last line (a write cut short), skipped", file=sys.stderr)


def repair_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read complete records and truncate the file to them, so appends continue cleanly."""
    records = read_jsonl(path)
    path = Path(path)
    if path.exists():
        good = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if path.read_bytes() != good.encode("utf-8"):  # bytes: a torn line may end inside a character
            with atomic_open(path) as f:
                f.write(good)
    return records
