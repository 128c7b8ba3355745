"""Where the time of an ``AsyncSaver.save`` call goes, per rank: the call's phases for ``bench_async.py``.

The library records two spans of the call in ``SaveResult.timings``:
``plan`` (describing the state and choosing writers) and ``snapshot`` (the
eager copies and the wait for the replica digests); the benchmark times the
call itself, the wait for the previous save before it and the lazy fence
before the next optimizer step (together: the stall).
:func:`install` adds the rest from the benchmark's side: it times each step
the saver runs on the training thread (``check``, ``enter``,
``prepare_guarded``, ``stage``, ``snapshot``) and the replica digests' join,
by putting a subclass of ``BackgroundSave`` in the saver's module. A slower
call then shows which phase grew:

    phase      what it holds
    wait       the benchmark's ``saver.wait()`` for the previous save, before the call
    check      the options and the path
    groups     the ranks' agreement that they entered the save, the private coordination group
    prepare    the prepare step beyond ``plan`` (agreement, gate)
    plan       the library's ``plan`` span
    stage      ring sizing, copy order, digest start, the writer's set-up
    copies     the eager copies (the library's ``snapshot`` less the digests' join)
    digests    waiting for the replica digests of the state at the call
    guard      the lazy save's snapshot guard and step pre-hooks
    other      the rest of the call: the saver's own wait, the hand-off to the workers
    call       the whole call, as the benchmark times it
    fence      a lazy save's wait before the next optimizer step
    stall      wait + call + fence: the figure the benchmark reports

Example::

    steps = []; install(steps); h = saver.save(path, state, mode="lazy"); h.wait()
    print(call_profile(steps[-1], h.result.timings, call_s=0.004))
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

PHASES = ("wait", "check", "groups", "prepare", "plan", "stage", "copies", "digests", "guard", "other", "call", "fence", "stall")
STEPS = {"check": "check", "enter": "groups", "prepare_guarded": "prepare", "stage": "stage", "snapshot": "snapshot"}


def _timed(fn: Callable, key: str) -> Callable:
    def wrapper(self, *args, **kwargs):
        t = time.monotonic()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.call_steps[key] = self.call_steps.get(key, 0.0) + time.monotonic() - t
    wrapper.__name__ = fn.__name__
    return wrapper


def install(sink: list[dict]) -> None:
    """Time the training-thread steps of every ``AsyncSaver`` call in this process: one dict per call into ``sink``.

    Example::

        steps = []; install(steps)
    """
    from shardpoint.saving import async_save, background

    base = background.BackgroundSave

    class TimedSave(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.call_steps: dict[str, float] = {}
            sink.append(self.call_steps)
            super().__init__(*args, **kwargs)

    for name, key in STEPS.items():
        if hasattr(base, name):
            setattr(TimedSave, name, _timed(getattr(base, name), key))
    stage = TimedSave.stage

    def stage_and_time_digests(self, *args, **kwargs):
        handle = stage(self, *args, **kwargs)
        replicas = getattr(getattr(self, "plan", None), "replicas", None)
        if replicas is not None and hasattr(replicas, "join"):
            join = replicas.join

            def timed_join(*a, **k):
                t = time.monotonic()
                try:
                    return join(*a, **k)
                finally:
                    self.call_steps["digests"] = self.call_steps.get("digests", 0.0) + time.monotonic() - t
            try:
                replicas.join = timed_join
            except AttributeError:  # a slotted or frozen table: its join stays inside "copies"
                pass
        return handle

    TimedSave.stage = stage_and_time_digests
    async_save.BackgroundSave = TimedSave


def call_profile(steps: dict[str, float], timings: dict[str, float], call_s: float,
                 wait_s: float = 0.0, fence_s: float = 0.0) -> dict[str, float]:
    """The call's phases in seconds (see the module docs) from the timed steps, the save's ``timings`` and the call.

    Example::

        call_profile({"snapshot": 0.004}, {"snapshot": 0.003}, call_s=0.005)["guard"]  # 0.001
    """
    plan = timings.get("plan", 0.0)
    digests = steps.get("digests", 0.0)
    recorded_snapshot = timings.get("snapshot", 0.0)
    out = {
        "check": steps.get("check", 0.0),
        "groups": steps.get("groups", 0.0),
        "prepare": max(0.0, steps.get("prepare", 0.0) - plan),
        "plan": plan,
        "stage": steps.get("stage", 0.0),
        "copies": max(0.0, recorded_snapshot - digests),
        "digests": digests,
        "guard": max(0.0, steps.get("snapshot", 0.0) - recorded_snapshot),
    }
    out["other"] = max(0.0, call_s - sum(out.values()))
    return {"wait": wait_s, **out, "call": call_s, "fence": fence_s, "stall": wait_s + call_s + fence_s}


def median_profile(profiles: list[dict[str, float]]) -> dict[str, float]:
    """Phase by phase, the median over several calls (missing phases count as zero).

    Example::

        median_profile([{"call": 1.0}, {"call": 3.0}, {"call": 2.0}])["call"]  # 2.0
    """
    if not profiles:
        return {}
    return {p: statistics.median(x.get(p, 0.0) for x in profiles) for p in PHASES}


def profile_table(system: str, per_rank: list[dict[str, float]],
                  what: str = "median over the measured checkpoints") -> str:
    """A compact text table, one row per rank, of median milliseconds per phase.

    Example::

        print(profile_table("sp-lazy", [median_profile(profiles_of_rank0)]))
    """
    head = f"# {system} call profile, ms ({what})"
    cols = "".join(f"{p:>8s}" for p in PHASES)
    lines = [head, f"{'rank':>6s}{cols}"]
    for rank, prof in enumerate(per_rank):
        if prof:
            lines.append(f"{rank:>6d}" + "".join(f"{prof.get(p, 0.0) * 1e3:8.1f}" for p in PHASES))
    return "\n".join(lines)
