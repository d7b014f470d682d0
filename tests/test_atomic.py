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
