"""A disk that fills up mid-run: a real size-limited tmpfs holds the output of regenerate and
capture. The run ends with one line that says what happened; what it wrote stays readable; the
same command, rerun with room, resumes and ends with what an uninterrupted run writes."""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from specdec.atomic import read_jsonl

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(kib): a tmpfs of that size (mounting needs root and CAP_SYS_ADMIN, as CI and this
    project's machines have)."""
    mounted = []

    def make(kib: int) -> Path:
        where = tmp_path / f"full-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def specdec(*args):
    return subprocess.run([sys.executable, "-m", "specdec", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=600)


def one_line_disk_error(r) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no space left on the device" in lines[-1] and "rerun the same command" in lines[-1]
    assert "Traceback" not in r.stderr


def test_regenerate_on_a_full_disk_then_resume(tiny_dirs, small_disk, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * 4}) + "\n" for i in range(120)))
    args = ["regenerate", "--target", tiny_dirs["llama"], "--prompts", prompts, "--max-new-tokens", "48",
            "--batch-size", "4", "--no-progress", "-o"]
    straight = tmp_path / "straight.jsonl"
    assert specdec(*args, straight).returncode == 0
    assert straight.stat().st_size > 3 * 8192
    full = small_disk(8) / "regen.jsonl"
    one_line_disk_error(specdec(*args, full))
    kept = read_jsonl(full)  # whole records only
    assert 1 <= len(kept) < 120
    moved = tmp_path / "regen.jsonl"
    shutil.copy(full, moved)
    assert specdec(*args, moved).returncode == 0
    assert sorted(read_jsonl(moved), key=lambda r: r["id"]) == sorted(read_jsonl(straight), key=lambda r: r["id"])


def test_capture_on_a_full_disk_then_resume(tiny_dirs, small_disk, tmp_path):
    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "messages": [
        {"role": "user", "content": f"question {i} " * 8}, {"role": "assistant", "content": f"answer {i} " * 12}]})
        + "\n" for i in range(40)))
    args = ["capture", "--target", tiny_dirs["llama"], "--data", data, "--shard-tokens", "64", "--batch-size", "2",
            "--no-progress", "-o"]
    straight = tmp_path / "straight"
    assert specdec(*args, straight).returncode == 0
    # The disk has room when capture checks, then another writer fills it after the first shard.
    size = sum(f.stat().st_size for f in straight.iterdir())
    disk = small_disk(size // 1024 + 256)
    out = disk / "cap"
    proc = subprocess.Popen([sys.executable, "-m", "specdec", *map(str, args), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while not (out / "manifest.json").exists() or not json.loads((out / "manifest.json").read_text())["shards"]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.005)
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:  # the disk is full now
        pass
    finally:
        os.close(fd)
    _, err = proc.communicate(timeout=120)
    one_line_disk_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", err))
    filler.unlink()
    assert specdec(*args, out).returncode == 0
    a, b = (json.loads((Path(d) / "manifest.json").read_text()) for d in (straight, out))
    assert a["num_samples"] == b["num_samples"] == 40
    ids = sorted(i for sh in b["shards"] for i in sh["sample_ids"])
    assert ids == sorted(i for sh in a["shards"] for i in sh["sample_ids"]) and len(set(ids)) == 40
