"""Saves in flight by path: tracked without touching the filesystem, found under any spelling of the path."""

from __future__ import annotations

import os
import threading

from shardpoint.engine import inflight


def test_tracking_a_save_resolves_nothing_and_a_lookup_finds_it_under_another_spelling(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    done = threading.Event()

    def no_resolving(path, *args, **kwargs):
        raise AssertionError(f"resolved {path} while tracking")

    with monkeypatch.context() as m:
        m.setattr(os.path, "realpath", no_resolving)
        inflight.track_save(str(tmp_path / "link" / "ck"), done)
    assert inflight.saves_in_flight(f"file://{tmp_path}/real/./ck") == 1
    assert inflight.wait_for_saves(str(tmp_path / "real" / "ck"), timeout=0.05) is False
    done.set()
    assert inflight.wait_for_saves(str(tmp_path / "link" / "ck"), timeout=0.05) is True
    assert inflight.saves_in_flight(str(tmp_path / "real" / "ck")) == 0


def test_a_relative_path_keeps_naming_the_same_place_after_a_change_of_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = threading.Event()
    inflight.track_save("ck", done)
    monkeypatch.chdir(os.sep)
    assert inflight.saves_in_flight(str(tmp_path / "ck")) == 1
    assert inflight.saves_in_flight("ck") == 0
    done.set()
