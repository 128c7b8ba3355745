"""Shared pieces of the hostile-input fuzz suite: a small checkpoint, a time bound, and verdicts.

Every trial ends in one of four outcomes:

- ``exact``: the load returned and every tensor and value equals what was saved, bit for bit;
- ``typed``: a :class:`shardpoint.CheckpointError` was raised;
- ``wrong``: the load returned something else (a silent wrong load);
- ``untyped`` / ``hang``: any other exception, or no answer within the time bound.

Only the first two are acceptable. Trials are seeded: ``SHARDPOINT_FUZZ_SEED`` picks the
seed (default 0) and ``SHARDPOINT_FUZZ_TRIALS`` the count (default 200; 500 or more for
the full run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

import shardpoint as sp

__all__ = [
    "TRIALS", "STRUCTURED_TRIALS", "SEED", "CASE_SECONDS", "Outcome", "Tally", "TrialTimeout", "time_bound",
    "build_state", "fresh_state", "save_small", "snapshot", "load_verdict", "read_verdict", "tensors_by_name",
    "copy_checkpoint",
]

TRIALS = int(os.environ.get("SHARDPOINT_FUZZ_TRIALS", "200"))
# Each structured-mutation test runs half as many by default (they re-seal and re-read more).
STRUCTURED_TRIALS = int(os.environ.get("SHARDPOINT_FUZZ_STRUCTURED", str(max(50, TRIALS // 2))))
SEED = int(os.environ.get("SHARDPOINT_FUZZ_SEED", "0"))
# Each case must end within this many seconds (they take milliseconds).
CASE_SECONDS = 5


class TrialTimeout(BaseException):
    """Raised by the alarm when a case runs past its bound (a BaseException: nothing may catch it)."""


@contextlib.contextmanager
def time_bound(seconds: float = CASE_SECONDS):
    """Raise :class:`TrialTimeout` in the main thread after ``seconds`` (interrupts a blocking ``open``)."""

    def fire(signum, frame):
        raise TrialTimeout(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def build_state() -> dict:
    """A small state with a model, an AdamW optimizer that has stepped, and plain values."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    extra = {"step": 11, "name": "fuzz", "lrs": [0.1, 0.2], "t": torch.arange(7, dtype=torch.int32), "h": torch.randn(3).half()}
    return {"model": model, "optim": opt, "extra": extra}


def fresh_state() -> dict:
    """A state of the same structure with different values, for loading into."""
    torch.manual_seed(99)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=5.0), "extra": {}}


def save_small(path: str) -> dict:
    """Save :func:`build_state` to ``path``; return its :func:`snapshot`."""
    state = build_state()
    sp.save(path, state)
    return snapshot(state)


def _flat(prefix: str, v, out: dict) -> None:
    if isinstance(v, torch.Tensor):
        t = v.detach().contiguous()
        out[prefix] = (str(t.dtype), tuple(t.shape), t.view(-1).view(torch.uint8).tolist() if t.numel() else [])
    elif isinstance(v, dict):
        for k, x in v.items():
            _flat(f"{prefix}.{k}", x, out)
    elif isinstance(v, (list, tuple)):
        out[prefix + ".<type>"] = type(v).__name__
        for i, x in enumerate(v):
            _flat(f"{prefix}.{i}", x, out)
    else:
        out[prefix] = (type(v).__name__, repr(v))


def snapshot(state: dict) -> dict:
    """Every tensor (dtype, shape, bytes) and value of a state, keyed by path: equal means bit-exact."""
    out: dict = {}
    _flat("model", state["model"].state_dict(), out)
    osd = state["optim"].state_dict()
    _flat("optim.state", osd["state"], out)
    _flat("optim.groups", [{k: v for k, v in g.items()} for g in osd["param_groups"]], out)
    _flat("extra", state["extra"], out)
    return out


@dataclass
class Outcome:
    kind: str  # exact, typed, wrong, untyped, hang
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind in ("exact", "typed")


def load_verdict(path: str, want: dict, exact: bool = True) -> Outcome:
    """Load ``path`` into a fresh state under the time bound and judge the result.

    With ``exact=False`` (a deliberate, re-sealed metadata edit) any completed
    load counts as acceptable: only untyped errors and hangs fail.
    """
    state = fresh_state()
    try:
        with time_bound():
            sp.load(path, state)
    except sp.CheckpointError as e:
        return Outcome("typed", f"{type(e).__name__}: {str(e)[:160]}")
    except TrialTimeout as e:
        return Outcome("hang", str(e))
    except Exception as e:  # noqa: BLE001 - what the suite exists to catch
        return Outcome("untyped", f"{type(e).__name__}: {str(e)[:300]}")
    if not exact:
        return Outcome("exact", "completed")
    got = snapshot(state)
    if got != want:
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        return Outcome("wrong", f"differs at {diff[:5]}")
    return Outcome("exact")


def tensors_by_name(path: str) -> dict:
    """Every tensor of an intact checkpoint, read by name: the reference for :func:`read_verdict`."""
    m = sp.read_manifest(path, chunks=False)
    return {name: sp.read_tensor(path, name) for name in m.tensors}


def read_verdict(path: str, want: dict) -> Outcome:
    """``sp.read_tensor`` of every tensor of ``want`` under the time bound: all bit-exact, or a typed error."""
    try:
        with time_bound():
            for name, t in want.items():
                got = sp.read_tensor(path, name)
                if got.dtype != t.dtype or got.shape != t.shape or not torch.equal(
                    got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                ):
                    return Outcome("wrong", f"read_tensor({name!r}) differs")
    except sp.CheckpointError as e:
        return Outcome("typed", f"{type(e).__name__}: {str(e)[:160]}")
    except TrialTimeout as e:
        return Outcome("hang", str(e))
    except Exception as e:  # noqa: BLE001
        return Outcome("untyped", f"{type(e).__name__}: {str(e)[:300]}")
    return Outcome("exact")


def copy_checkpoint(src: str, dst: str) -> str:
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


@dataclass
class Tally:
    """Counts of outcomes, and the first few failures with their trial descriptions."""

    counts: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)

    def add(self, what: str, o: Outcome) -> None:
        self.counts[o.kind] += 1
        if not o.ok and len(self.failures) < 10:
            self.failures.append(f"{what}: {o.kind}: {o.detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def passed(self) -> int:
        return self.counts["exact"] + self.counts["typed"]

    def line(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        return f"{self.passed} of {self.total} held ({parts})"
