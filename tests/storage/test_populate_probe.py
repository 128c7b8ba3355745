"""Asking whether MADV_POPULATE_READ works reads nothing, and no answer is kept for the process."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

import shardpoint.storage.local_read as local_read
from shardpoint.storage.local_read import populate_supported, resident_fraction


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")
def test_the_probe_brings_no_page_in(tmp_path):
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ | mmap.PROT_WRITE, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
    if resident_fraction(mm, 0, 1 << 20) != 0.0:
        pytest.skip("the page cache kept the file")
    populate_supported(mm)
    assert resident_fraction(mm, 0, 1 << 20) == 0.0
    mm.close()


def test_the_answer_follows_the_kernel_each_time(monkeypatch):
    mm = mmap.mmap(-1, 4096)
    calls = []

    class Libc:
        def madvise(self, addr, length, advice):
            calls.append((length.value, advice.value))
            return -1 if len(calls) > 1 else 0

    monkeypatch.setattr(local_read, "_LIBC", Libc())
    monkeypatch.setattr(local_read.sys, "platform", "linux")
    assert populate_supported(mm) is True
    assert populate_supported(mm) is False  # asked again, not remembered
    assert calls == [(0, local_read.MADV_POPULATE_READ)] * 2
