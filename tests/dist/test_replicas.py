"""The replica check at save and replication declared per tensor, on real gloo processes.

Each launch runs several cases in one process group, since starting
processes is the expensive part.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch(2, "tests.dist.replica_cases:per_rank_job", {"root": str(tmp_path_factory.mktemp("per_rank"))})


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return launch(4, "tests.dist.replica_cases:groups_job", {"root": str(tmp_path_factory.mktemp("groups"))})


@pytest.fixture(scope="module")
def at_commit(tmp_path_factory):
    return launch(2, "tests.dist.replica_cases:commit_job", {"root": str(tmp_path_factory.mktemp("at_commit"))})


def test_without_declared_groups_the_check_adds_no_gather_before_the_write(at_commit):
    for r in at_commit:
        assert r["gathers_plain"] == 0 and r["gathers_declared"] == 1, r


@pytest.mark.parametrize("case,where", [("sync", "call"), ("async", "wait"), ("fixed_after_call", "wait")])
def test_a_mismatch_found_at_the_commit_fails_every_rank_alike(at_commit, case, where):
    first = at_commit[0][case]
    assert first[0] == "ReplicaMismatchError" and first[4] == where, first
    assert first[2] == "model.experts.1.weight" and first[3] == [[0], [1]], first
    assert "'model.experts.1.weight'" in first[1] and "ranks [0]; ranks [1]" in first[1] and "replicated_over" in first[1]
    assert all(r[case] == first for r in at_commit)  # the same class, message, tensor and ranks on every rank


def test_a_mismatch_found_at_the_commit_leaves_the_checkpoint_bit_exact(at_commit):
    for r in at_commit:
        assert r["manifest_kept"] and r["files_kept"] and r["kept"] == [], r


def test_the_digests_are_of_the_state_at_the_call(at_commit):
    for r in at_commit:
        assert r["drift"] == [] and r["drift_loaded"] == [], r
        assert r["reused"][0] == "ReplicaMismatchError" and r["reused"][2] == "model.bias" and r["reused"][4] == "wait", r


def test_a_lazy_save_digests_its_lazy_copies_off_the_training_thread_and_still_refuses(at_commit):
    for r in at_commit:
        # The buffer alongside the call's copies, the 4 parameters on the lazy copy's worker; none on the training thread.
        assert r["lazy_threads"] == [["shardpoint-replica-digests", 1], ["shardpoint-save", 4]], r["lazy_threads"]
        name, _msg, tensor, ranks, where = r["lazy"]
        assert name == "ReplicaMismatchError" and tensor == "model.experts.0.weight" and ranks == [[0], [1]], r["lazy"]
        assert where == "wait"


def test_a_lazy_save_changed_outside_step_before_its_fence_is_refused_by_its_guard(at_commit):
    for r in at_commit:
        name, msg, _tensor, _ranks, where = r["lazy_torn"]
        assert name == "TornSnapshotError" and "'model.dense.weight' changed in place" in msg and where == "wait", msg
        assert r["lazy_torn_names"] == ["model.bias", "model.dense.bias", "model.dense.weight", "model.experts.0.weight",
                                        "model.experts.1.weight"], r  # the earlier checkpoint, without the optimizer


def test_ranks_that_disagree_on_declaring_groups_are_stopped_at_entry(at_commit):
    for r in at_commit:
        name, msg = r["disagree"]
        assert name == "DistributedError" and "save with replicated_over of" in msg and "rank 0 is in save with" in msg, r


def test_per_rank_plain_tensors_are_refused_naming_the_tensor_and_ranks(per_rank):
    for r in per_rank:
        name, msg, tensor, ranks = r["p1"]
        assert name == "ReplicaMismatchError" and tensor == "model.experts.0.weight", r["p1"]
        assert ranks == [[0], [1]] and "'model.experts.0.weight'" in msg and "replicated_over" in msg
        assert r["p1_async"][0] == "ReplicaMismatchError" and r["p1_async"][2] == "model.experts.0.weight", r["p1_async"]
        # The failed saves left the earlier checkpoint at the path whole.
        assert r["p1_kept"] == []


def test_a_buffer_differing_in_one_element_is_refused(per_rank):
    for r in per_rank:
        assert r["p1_buffer"][0] == "ReplicaMismatchError" and r["p1_buffer"][2] == "model.bias", r["p1_buffer"]


def test_ddp_replicas_pass_and_load_bit_exact(per_rank):
    for r in per_rank:
        assert r["ddp_model"] == [] and r["ddp_opt"] == [], r


def test_groups_declared_by_pattern_keep_each_groups_values(groups):
    for r in groups:
        assert r["p2_model"] == [] and r["p2_opt"] == [] and r["pairs"] == [] and r["async"] == [], r
        names = r["names"]
        assert "model.dense.weight" in names and "model.experts.0.weight@ranks0,1" in names
        assert "model.experts.0.weight@ranks2,3" in names and "model.experts.0.weight" not in names
        assert "optimizer.state.model.experts.1.weight.exp_avg@ranks2,3" in names
        assert "optimizer.state.model.dense.weight.exp_avg" in names


@pytest.mark.parametrize("case", ["p2w", "p2w_pattern"])
def test_a_wrong_declaration_is_refused_and_the_checkpoint_kept(groups, case):
    for r in groups:
        name, msg, tensor, ranks = r[case]
        assert name == "ReplicaMismatchError" and ranks == [[0, 1], [2, 3]], r[case]
        assert tensor in ("model.bias", "model.experts.0.weight") and "model.experts.0.weight" in msg
        assert r["p2w_kept"] == []
