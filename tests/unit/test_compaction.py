"""Retention in incremental runs moves referenced chunks out of partly referenced data files (compaction)."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint.convert.verify import verify_checkpoint
from shardpoint.errors import CorruptCheckpointError
from shardpoint.manager.compact import holders, plan_file, read_kept
from shardpoint.manager.retention import Retention, StepsInUse
from shardpoint.manager.steplock import StepLock
from tests.unit.compaction_runs import (
    check_exact, check_loads, committed, lora_state, referenced_bytes, run_steps, stored_data_bytes,
)

BASE_BYTES = (256 * 64 + 64) * 4  # base.w and base.b, float32


@pytest.fixture(params=["local", "memory"])
def run(request, tmp_path):
    return sp.LocalStorage(str(tmp_path)) if request.param == "local" else sp.MemoryStorage()


def _holder(run) -> list[str]:
    return run.child("step_00000001").list("")


def test_retention_leaves_exactly_the_bytes_kept_steps_reference(run):
    saved = run_steps(run, range(1, 7), keep_last=2)
    assert committed(run) == [5, 6]
    check_exact(run, saved)
    # Step 1's data file now holds the frozen base alone: its adapters and moments are gone.
    (name,) = _holder(run)
    assert run.child("step_00000001").size(name) == BASE_BYTES
    assert stored_data_bytes(run) == BASE_BYTES + 2 * (2 * 2 * 8 * 64 * 4)  # plus each kept step's adapters and moments


def test_without_compaction_the_removed_adapters_would_stay(tmp_path):
    # The same run keeping everything, then one pass that only deletes: the accounting tells them apart.
    run = sp.LocalStorage(str(tmp_path))
    run_steps(run, range(1, 7), keep_last=None)
    full = run.child("step_00000001").size(run.child("step_00000001").list("data/")[0])
    assert full > BASE_BYTES
    ret = Retention(run, 2, None, StepsInUse(), StepLock("test", 60.0), incremental=True)
    ret.run_pass()
    assert committed(run) == [5, 6]
    assert stored_data_bytes(run) == referenced_bytes(run, [5, 6])


def test_a_wholly_referenced_file_is_kept_as_it_is(run):
    run_steps(run, range(1, 5), keep_last=2)
    (first,) = _holder(run)
    saved = run_steps(run, range(5, 9), keep_last=2)  # the base never changes: nothing more to move
    assert _holder(run) == [first]
    check_exact(run, saved)


def test_a_damaged_moved_chunk_fails_every_load_that_reads_it(tmp_path):
    run = sp.LocalStorage(str(tmp_path))
    run_steps(run, range(1, 5), keep_last=2)
    (name,) = _holder(run)
    path = os.path.join(str(tmp_path), "step_00000001", name)
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    for s in (3, 4):
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            sp.load(run.child(f"step_{s:08d}"), {}, strict=False)


class Boom(Exception):
    pass


class Dies:
    """Raises at the ``nth`` compaction point and at every hook after it, as a killed process does nothing more."""

    def __init__(self, nth: int):
        self.nth, self.seen, self.dead = nth, 0, False

    def __call__(self, phase, step, rank):
        if self.dead:
            raise Boom(phase)
        if phase == "compact":
            self.seen += 1
            if self.seen == self.nth:
                self.dead = True
                raise Boom(f"compact #{self.nth}")


@pytest.mark.parametrize("nth", [1, 2, 3, 4, 5])
def test_a_crash_at_any_point_of_compaction_leaves_every_kept_step_loadable(run, nth):
    hook = Dies(nth)
    saved: dict = {}
    st = lora_state()
    try:
        for step in range(1, 7):
            saved.update(run_steps(run, [step], keep_last=2, hook=hook, st=st))
    except Boom:
        pass
    assert hook.dead, "the compaction never reached that point"
    check_loads(run, saved)  # every committed step, as the crash left it
    # A later run's passes remove what the crash left and finish the move.
    saved.update(run_steps(run, range(10, 13), keep_last=2))
    check_exact(run, saved)


def test_compaction_waits_while_a_save_or_restore_runs():
    in_use = StepsInUse()
    token = in_use.quiet()
    assert token is not None and in_use.run_if_quiet(token, lambda: 1) == 1
    in_use.start_writing(5)
    assert in_use.quiet() is None and in_use.run_if_quiet(token, lambda: 1) is None
    in_use.finish_writing(5)
    assert in_use.run_if_quiet(token, lambda: 1) is None  # a save ran since the token: the pass's listing is stale
    token = in_use.quiet()
    steps = in_use.protect(lambda: [3])
    assert in_use.run_if_quiet(token, lambda: 1) is None
    in_use.release(steps)
    assert in_use.run_if_quiet(token, lambda: 1) == 1


def test_a_pass_during_a_save_deletes_but_moves_nothing(tmp_path):
    run = sp.LocalStorage(str(tmp_path))
    saved = run_steps(run, range(1, 7), keep_last=None)
    in_use = StepsInUse()
    ret = Retention(run, 2, None, in_use, StepLock("test", 60.0), incremental=True)
    in_use.start_writing(7)
    ret.run_pass()
    assert committed(run) == [5, 6] and len(_holder(run)) == 1
    assert stored_data_bytes(run) > referenced_bytes(run, [5, 6])  # the whole file is spared, not moved
    check_loads(run, saved)
    in_use.finish_writing(7)
    ret.run_pass()
    check_exact(run, saved)


def test_a_doomed_step_being_restored_keeps_what_it_references(tmp_path):
    # Step 3 is doomed but in use (a restore falls back to it): it stays this pass, and so does the data it
    # references in step 1's folder, although no step outside the doomed ones references that data.
    run = sp.LocalStorage(str(tmp_path))
    saved = run_steps(run, range(1, 4), keep_last=None)
    st = lora_state()
    for k in ("base.w", "base.b"):  # the base changes at step 4: steps 4 and 5 reference nothing older
        st["model"][k].add_(1.0)
    for step in (4, 5):
        saved.update(run_steps(run, [step], keep_last=None, st=st))
        st = {g: {k: v.clone() for k, v in d.items()} for g, d in saved[step].items()}
    in_use = StepsInUse()
    restoring = in_use.protect(lambda: [3])
    ret = Retention(run, 2, None, in_use, StepLock("test", 60.0), incremental=True)
    ret.run_pass()
    assert committed(run) == [3, 4, 5]
    check_loads(run, saved)  # step 3 still loads: its base data in step 1's folder was spared
    in_use.release(restoring)
    ret.run_pass()
    assert committed(run) == [4, 5]
    check_exact(run, saved)


def test_a_file_referenced_with_another_size_is_left_alone(tmp_path):
    run = sp.LocalStorage(str(tmp_path))
    run_steps(run, range(1, 4), keep_last=None)
    kept = read_kept(run, [2, 3])
    ((folder, data), users), = holders(kept).items()
    assert plan_file(run, folder, data, users, kept) is not None
    with open(os.path.join(str(tmp_path), folder, data), "ab") as f:
        f.write(b"\0" * 64)  # the file no longer matches what the references say
    assert plan_file(run, folder, data, users, kept) is None


def test_manifests_switched_by_compaction_keep_their_integrity(tmp_path):
    run = sp.LocalStorage(str(tmp_path))
    saved = run_steps(run, range(1, 4), keep_last=2)
    for s in (2, 3):
        m = sp.read_manifest(run.child(f"step_{s:08d}"), chunks=False)
        (ref,) = m.refs
        assert ref.base == "../step_00000001" and ref.size == BASE_BYTES
        assert set(m.files) == set(run.child(f"step_{s:08d}").list("data/"))  # old index files removed
    for s in (2, 3):
        checked, problems = verify_checkpoint(str(tmp_path / f"step_{s:08d}"))
        assert problems == [] and checked == 6
    check_loads(run, saved)
    assert torch.equal(sp.load(run.child("step_00000002"), {}, strict=False)["model"]["base.w"], lora_state()["model"]["base.w"])
