"""Per-rank random number generator state, saved and restored with ``sp.save``/``sp.load``.

:class:`RNGState` is a ``Stateful`` object: put it in the state dict and each
rank's generators are saved, each rank writing its own row::

    state = {"model": model, "optimizer": opt, "rng": RNGState()}
    sp.save("ckpt/last", state)
    ...
    sp.load("ckpt/last", state)      # restores the generators of this rank

It captures, on every rank:

* ``torch``: the CPU default generator (``torch.get_rng_state()``, 5056 bytes);
* ``cuda``: the CUDA generator of the current device (or of every visible
  device, with ``cuda="all"``), when ``torch.cuda.is_available()``. This path
  has not been exercised on a GPU machine in shardpoint's own test suite; its
  logic is unit-tested against a stand-in for ``torch.cuda``;
* ``python``: the global ``random`` generator (``random.getstate()``);
* ``numpy``: NumPy's global legacy generator (``np.random.get_state()``).

**Storage.** Each generator's state is packed into a row of bytes (no
pickle), and the rows of all ranks form one ``uint8`` tensor of shape
``(world_size, row_bytes)``. Manifest values come from rank 0 only and a plain
tensor counts as identical on every rank, so per-rank rows are handed to
``sp.save`` as a ``DTensor`` sharded on dimension 0 over a 1-D mesh of all
ranks: rank ``r`` owns and writes row ``r``. Without a process group (or with
one rank) the rows are plain tensors of one row. The tensors are named
``<key>.rows_w<world_size>.<generator>``: the saved world size is part of the
name, so that loading at another world size reads the saved rows whole
instead of failing on a shape mismatch with this run's sharded rows.

**Restoring.** With the same number of ranks, rank ``r`` restores row ``r``
exactly: the next ``torch.rand``, ``random.random`` and ``np.random.rand`` on
every rank are bit-identical to what they would have been without the
checkpoint. With another number of ranks, ``on_resize`` decides:

* ``"derive"`` (default): rank ``r`` restores row ``r`` exactly while
  ``r < saved_world`` (so on 4 -> 2, ranks 0 and 1 continue their streams);
  a rank ``r >= saved_world`` seeds each generator from a 64-bit BLAKE2b hash
  of (row ``r % saved_world`` of that generator, ``r``, the generator's
  name): deterministic, and distinct from every other rank's stream.
* ``"wrap"``: rank ``r`` restores row ``r % saved_world`` exactly. Growing the
  world then gives several ranks the same streams (e.g. identical dropout
  masks on two data-parallel ranks); choose it only if that is what you want.
* ``"error"``: raise ``ValueError``.

Generators in the checkpoint that this process lacks (CUDA on a CPU-only
machine) are skipped with a warning; generators this process has but the
checkpoint lacks are left as they are. ``last_restore`` records what the last
load did on this rank.

Example::

    >>> import random, torch
    >>> rng = RNGState(); saved = rng.state_dict()
    >>> a = (torch.rand(2), random.random())
    >>> rng.load_state_dict(saved)
    >>> b = (torch.rand(2), random.random())
    >>> torch.equal(a[0], b[0]) and a[1] == b[1]
    True
"""

from __future__ import annotations

import hashlib
import random
import struct
import warnings
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["RNGState", "GENERATORS", "RESIZE_POLICIES", "pick_row", "derive_seed", "capture_rows", "restore_rows"]

STATE_VERSION = 1
GENERATORS = ("torch", "cuda", "python", "numpy")
RESIZE_POLICIES = ("derive", "wrap", "error")
_PY_WORDS = 625  # Mersenne Twister: 624 state words plus the index
_NP_WORDS = 624


# ---------------------------------------------------------------- packing
def _to_row(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _pack_python(state: tuple) -> torch.Tensor:
    version, words, gauss = state
    if len(words) != _PY_WORDS:
        raise ValueError(f"unexpected Python random state with {len(words)} words")
    return _to_row(
        struct.pack("<I", version)
        + np.asarray(words, dtype="<u4").tobytes()
        + struct.pack("<Bd", gauss is not None, 0.0 if gauss is None else gauss)
    )


def _unpack_python(row: bytes) -> tuple:
    (version,) = struct.unpack_from("<I", row, 0)
    words = tuple(int(w) for w in np.frombuffer(row, dtype="<u4", count=_PY_WORDS, offset=4))
    has, gauss = struct.unpack_from("<Bd", row, 4 + 4 * _PY_WORDS)
    return version, words, (gauss if has else None)


def _pack_numpy(state: tuple) -> torch.Tensor:
    name, keys, pos, has_gauss, cached = state[:5]
    if name != "MT19937" or len(keys) != _NP_WORDS:
        raise ValueError(f"unexpected NumPy global generator state {name!r}")
    return _to_row(np.asarray(keys, dtype="<u4").tobytes() + struct.pack("<IBd", pos, bool(has_gauss), cached))


def _unpack_numpy(row: bytes) -> tuple:
    keys = np.frombuffer(row, dtype="<u4", count=_NP_WORDS).astype(np.uint32)
    pos, has, cached = struct.unpack_from("<IBd", row, 4 * _NP_WORDS)
    return ("MT19937", keys, int(pos), int(has), float(cached))


def _cuda_devices(mode: str) -> list[int]:
    if mode == "all":
        return list(range(torch.cuda.device_count()))
    return [torch.cuda.current_device()]


def capture_rows(generators=GENERATORS, cuda: str = "current") -> dict[str, torch.Tensor]:
    """This process's generator states, each packed as a 1-D ``uint8`` tensor.

    ``cuda`` is captured only when ``torch.cuda.is_available()``: the current
    device's state (``cuda="current"``) or every visible device's, one after
    another (``cuda="all"``).

    Example::

        >>> sorted(capture_rows(("torch", "python")))
        ['python', 'torch']
    """
    rows: dict[str, torch.Tensor] = {}
    for name in generators:
        if name == "torch":
            rows[name] = torch.get_rng_state().clone()
        elif name == "python":
            rows[name] = _pack_python(random.getstate())
        elif name == "numpy":
            rows[name] = _pack_numpy(np.random.get_state(legacy=True))
        elif name == "cuda":
            if torch.cuda.is_available():
                parts = [torch.cuda.get_rng_state(d).cpu() for d in _cuda_devices(cuda)]
                rows[name] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        else:
            raise ValueError(f"unknown generator {name!r}; choose from {GENERATORS}")
    return rows


def restore_rows(rows: Mapping[str, Any], cuda: str = "current") -> list[str]:
    """Set this process's generators from packed rows (as :func:`capture_rows` made them).

    Returns the names restored; a ``cuda`` row is skipped (with a warning)
    when CUDA is not available.

    Example::

        >>> import random
        >>> rows = capture_rows(("python",)); x = random.random()
        >>> restore_rows(rows); random.random() == x
        ['python']
        True
    """
    done = []
    for name, row in rows.items():
        data = bytes(_as_cpu_uint8(row).numpy().tobytes())
        if name == "torch":
            torch.set_rng_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        elif name == "python":
            random.setstate(_unpack_python(data))
        elif name == "numpy":
            np.random.set_state(_unpack_numpy(data))
        elif name == "cuda":
            if not torch.cuda.is_available():
                warnings.warn("the checkpoint holds CUDA RNG state but CUDA is not available here: skipped")
                continue
            devices = _cuda_devices(cuda)
            size = len(torch.cuda.get_rng_state(devices[0])) if devices else 0
            saved = len(data) // size if size else 0
            if saved != len(devices):
                warnings.warn(f"the checkpoint holds CUDA RNG state for {saved} device(s), this rank has {len(devices)}: "
                              f"restoring the first {min(saved, len(devices))}")
            for i, d in enumerate(devices[:saved]):
                torch.cuda.set_rng_state(torch.frombuffer(bytearray(data[i * size:(i + 1) * size]), dtype=torch.uint8), d)
        else:
            raise ValueError(f"unknown generator {name!r} in RNG state; choose from {GENERATORS}")
        done.append(name)
    return done


def _as_cpu_uint8(t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"RNG row must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"RNG row must be a 1-D uint8 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return t.detach().cpu().contiguous()


# ---------------------------------------------------------------- policy
def pick_row(policy: str, rank: int, world: int, saved_world: int) -> tuple[int, bool]:
    """Which saved row rank ``rank`` of ``world`` starts from, and whether it restores it exactly.

    ``(row, True)``: restore row ``row`` as is; ``(row, False)``: seed from a
    hash of row ``row`` and ``rank`` (see :func:`derive_seed`).

    Example::

        >>> pick_row("derive", 1, 2, 4), pick_row("derive", 5, 8, 4), pick_row("wrap", 5, 8, 4)
        ((1, True), (1, False), (1, True))
    """
    if policy not in RESIZE_POLICIES:
        raise ValueError(f"unknown on_resize policy {policy!r}; choose from {RESIZE_POLICIES}")
    if saved_world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad layout: rank {rank} of {world}, saved world {saved_world}")
    if world == saved_world:
        return rank, True
    if policy == "error":
        raise ValueError(
            f"RNG state was saved by {saved_world} rank(s) and is loaded by {world}; "
            "pass on_resize='derive' or 'wrap' to RNGState to allow this"
        )
    if policy == "wrap" or rank < saved_world:
        return rank % saved_world, True
    return rank % saved_world, False


def derive_seed(row: bytes, rank: int, name: str) -> int:
    """A 64-bit seed from a saved row, the new rank and the generator's name (BLAKE2b).

    Example::

        >>> derive_seed(b"abc", 3, "torch") == derive_seed(b"abc", 3, "torch") != derive_seed(b"abc", 4, "torch")
        True
    """
    h = hashlib.blake2b(digest_size=8, person=b"shardpoint.rng1")
    h.update(name.encode())
    h.update(int(rank).to_bytes(8, "little"))
    h.update(row)
    return int.from_bytes(h.digest(), "little")


def seed_generators(rows: Mapping[str, bytes], rank: int, cuda: str) -> list[str]:
    """Seed each named generator (``torch``, ``python``, ``numpy``, ``cuda``) from its saved row for ``rank``.

    Used when a run resumes on a different world size: each rank derives its own
    stream from the saved state instead of copying another rank's. Returns the
    names seeded; raises ``ValueError`` for an unknown generator name.
    """
    done = []
    for name, data in rows.items():
        seed = derive_seed(data, rank, name)
        if name == "torch":
            torch.default_generator.manual_seed(seed)
        elif name == "python":
            random.seed(seed)
        elif name == "numpy":
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
        elif name == "cuda":
            if not torch.cuda.is_available():
                warnings.warn("the checkpoint holds CUDA RNG state but CUDA is not available here: skipped")
                continue
            for d in _cuda_devices(cuda):
                torch.cuda.default_generators[d].manual_seed(derive_seed(data, rank, f"cuda{d}"))
        else:
            raise ValueError(f"unknown generator {name!r} in RNG state; choose from {GENERATORS}")
        done.append(name)
    return done


# ---------------------------------------------------------------- the Stateful
def _default_layout(kept: tuple[Any, Any] | None) -> tuple[int, int, Any, tuple[Any, Any] | None]:
    """(rank, world, mesh, what to keep) over the default process group; mesh is None for one rank.

    ``kept`` is the caller's last ``(fingerprint, mesh)``: the mesh is reused
    only while the default group and world size are the ones it was made for.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, None, kept
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return rank, world, None, kept
    # A CPU mesh: the rows stay in host memory, and no DTensor operation ever runs on them, so
    # the mesh only names who owns which row. Over the whole world it reuses the default group.
    group = dist.distributed_c10d._get_default_group()
    if kept is not None and kept[0][0] is group and kept[0][1] == world:
        return rank, world, kept[1], kept
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return rank, world, mesh, ((group, world), mesh)


class RNGState:
    """``Stateful`` per-rank RNG state: torch CPU, CUDA, Python ``random`` and NumPy (module docs).

    ``generators`` picks what to capture (default: all of :data:`GENERATORS`;
    ``cuda`` only where available). ``on_resize`` is the policy for loading
    at another world size (``"derive"``, ``"wrap"`` or ``"error"``). ``cuda``
    is ``"current"`` (this rank's device) or ``"all"`` (every visible device).
    ``mesh`` is a 1-D ``DeviceMesh`` of the ranks that save together (default:
    all ranks of the default process group); pass it when ``sp.save`` runs on
    a subgroup.

    ``state_dict()`` captures the generators *now*: call ``sp.save`` at the
    point you want to resume from.

    Example::

        state = {"model": model, "optimizer": opt, "rng": RNGState()}
        sp.save("ckpt/last", state)                  # every rank writes its own row
        sp.load("ckpt/last", state)                  # same world: bit-exact streams
        state["rng"].last_restore                    # {'row': 3, 'exact': True, 'saved_world': 4, ...}
    """

    def __init__(self, generators=GENERATORS, *, on_resize: str = "derive", cuda: str = "current", mesh: Any = None) -> None:
        unknown = [g for g in generators if g not in GENERATORS]
        if unknown:
            raise ValueError(f"unknown generator(s) {unknown}; choose from {GENERATORS}")
        if on_resize not in RESIZE_POLICIES:
            raise ValueError(f"unknown on_resize policy {on_resize!r}; choose from {RESIZE_POLICIES}")
        if cuda not in ("current", "all"):
            raise ValueError(f"cuda must be 'current' or 'all', got {cuda!r}")
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"mesh must be 1-D, got {mesh.ndim} dimensions")
        self.generators = tuple(generators)
        self.on_resize = on_resize
        self.cuda = cuda
        self.mesh = mesh
        self.last_restore: dict[str, Any] | None = None
        self._world_mesh: tuple[Any, Any] | None = None  # ((default group, world), mesh) made for it

    def _layout(self) -> tuple[int, int, Any]:
        if self.mesh is not None:
            return int(self.mesh.get_local_rank()), int(self.mesh.size()), self.mesh
        rank, world, mesh, self._world_mesh = _default_layout(self._world_mesh)
        return rank, world, mesh

    def state_dict(self) -> dict[str, Any]:
        """This rank's generators now, as rows of a ``(world_size, bytes)`` tensor per generator.

        Example::

            >>> sd = RNGState(("torch",)).state_dict()       # no process group: one row
            >>> sd["world_size"], tuple(sd["rows_w1"]["torch"].shape)
            (1, (1, 5056))
        """
        rank, world, mesh = self._layout()
        rows = capture_rows(self.generators, self.cuda)
        out: dict[str, Any] = {}
        for name, row in rows.items():
            local = row.unsqueeze(0)
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                n = local.shape[1]
                local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((world, n)), stride=(n, 1))
            out[name] = local
        return {
            "version": STATE_VERSION,
            "world_size": world,
            "generators": sorted(rows),
            f"rows_w{world}": out,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's generators from a saved state, applying ``on_resize`` if the world changed.

        Example::

            >>> import torch
            >>> rng = RNGState(("torch",)); sd = rng.state_dict(); x = torch.rand(1)
            >>> rng.load_state_dict(sd); bool(torch.rand(1) == x), rng.last_restore["exact"]
            (True, True)
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"unsupported RNG state (version {got!r}; this shardpoint reads {STATE_VERSION})")
        saved_world = state.get("world_size")
        tensors = state.get(f"rows_w{saved_world}")
        if not isinstance(saved_world, int) or saved_world < 1 or not isinstance(tensors, dict):
            raise ValueError(f"malformed RNG state: world_size {saved_world!r}, rows {type(tensors).__name__}")
        rank, world, _ = self._layout()
        row, exact = pick_row(self.on_resize, rank, world, saved_world)
        mine: dict[str, bytes] = {}
        for name, t in tensors.items():
            if name not in self.generators:
                continue
            mine[name] = bytes(_row_of(t, row, saved_world, name).numpy().tobytes())
        if exact:
            restored = restore_rows({k: _to_row(v) for k, v in mine.items()}, self.cuda)
        else:
            restored = seed_generators(mine, rank, self.cuda)
        self.last_restore = {
            "row": row,
            "exact": exact,
            "saved_world": saved_world,
            "world": world,
            "generators": sorted(restored),
        }


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _row_of(t: Any, row: int, saved_world: int, name: str) -> torch.Tensor:
    """Row ``row`` of a saved ``(saved_world, n)`` tensor: a full plain tensor, or this rank's DTensor shard."""
    if _is_dtensor(t):
        # Only this run's own rows come back as a DTensor (same world size): the local shard is row ``row``.
        local = t.to_local()
        if tuple(t.shape)[0] != saved_world or local.shape[0] != 1:
            raise ValueError(f"RNG rows for {name!r}: unexpected sharded shape {tuple(t.shape)}")
        return _as_cpu_uint8(local[0])
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != saved_world:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"RNG rows for {name!r} must have shape ({saved_world}, n), got {shape}")
    return _as_cpu_uint8(t[row])
