import os

import pytest

from shardpoint.storage.durable import fsync_path


def test_fsync_path_syncs_files_and_folders(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x")
    fsync_path(str(f))
    fsync_path(str(tmp_path))
    assert f.read_bytes() == b"x"


def test_fsync_path_raises_unless_told_to_ignore(tmp_path):
    missing = os.path.join(str(tmp_path), "gone")
    with pytest.raises(FileNotFoundError):
        fsync_path(missing)
    assert fsync_path(missing, ignore_errors=True) is None
