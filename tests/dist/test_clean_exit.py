"""Every rank of a multi-rank save exits with status 0, run after run.

A rank that aborted at interpreter exit (SIGABRT, ``terminate called
without an active exception``) after its work succeeded counts as a failed
worker under torchrun. The ranks here are separate interpreters that exit
normally, with and without ``destroy_process_group``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.storage.s3_helpers import free_port

pytestmark = pytest.mark.dist

RUNS = 3
WORLD = 2


@pytest.mark.parametrize("run", range(RUNS))
def test_every_rank_exits_zero(tmp_path, run):
    port = free_port()
    env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    destroy = "1" if run % 2 else "0"
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.dist.exit_worker", str(tmp_path), destroy],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(WORLD)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert f"rank {r} finished" in out or "rank ? finished" in out, err[-3000:]
        assert "private group destroyed" in out, out
        assert "terminate called" not in err and "Fatal Python error" not in err, err[-3000:]
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-3000:]}"
