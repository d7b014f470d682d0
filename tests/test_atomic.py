"""Crash-safe writes leave files with the permissions a plain open() would give."""

import os

from specdec.atomic import write_json


def test_new_files_get_the_umask_mode_and_rewrites_keep_theirs(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "config.json", {"a": 1})
        assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o644
        os.chmod(tmp_path / "config.json", 0o640)
        write_json(tmp_path / "config.json", {"a": 2})
        assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o640
        assert (tmp_path / "config.json").read_text().strip().endswith("}")
    finally:
        os.umask(old)
    assert not list(tmp_path.glob(".*.tmp"))


def test_read_jsonl_names_a_broken_line_and_drops_only_a_torn_last_one(tmp_path, capsys):
    import pytest

    from specdec.atomic import read_jsonl, repair_jsonl
    from specdec.errors import SpecdecError

    good = b'{"id": 1}\n{"id": 2}\n'
    p = tmp_path / "a.jsonl"
    for bad, why in ((b'{"id": \n', "not valid JSON"), (b'{"id": "\xff"}\n', "not valid UTF-8"),
                     (b"[1, 2]\n", "a JSON list, expected an object")):
        p.write_bytes(good[:10] + bad + good[10:])
        with pytest.raises(SpecdecError, match=rf"a\.jsonl, line 2: {why}"):
            read_jsonl(p)
        with pytest.raises(SpecdecError):  # a resume refuses too, and leaves the file as it was
            repair_jsonl(p)
        assert p.read_bytes() == good[:10] + bad + good[10:]
    # Killed mid-write: the last line has no newline, and may end inside a UTF-8 character.
    p.write_bytes(good + '{"id": "é'.encode()[:-1])
    assert read_jsonl(p) == [{"id": 1}, {"id": 2}]
    assert "line 3: incomplete last line" in capsys.readouterr().err
    assert repair_jsonl(p) == [{"id": 1}, {"id": 2}] and p.read_bytes() == good


def test_files_a_library_writes_itself_get_the_umask_mode_too(tmp_path):
    """safetensors replaces the file it is given with a 0600 one of its own: an exported drafter
    would be unreadable by a server running as another user."""
    import torch
    from safetensors.torch import save_file

    from specdec.atomic import atomic_path

    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
