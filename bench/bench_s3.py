"""Save and load throughput through S3 on loopback (moto) against the local backend and DCP's fsspec path.

One process, one state (a stack of fp32 linear layers), saved and loaded by:

- shardpoint to a local folder (fsync on; loads hit the warm page cache);
- shardpoint to ``s3://`` (boto3: parallel multipart parts, parallel ranged GETs),
  with its default merging of nearby ranged reads and with merging off
  (``read_merge_gap=None``, the backend before this option existed);
- shardpoint through its generic fsspec bridge over s3fs (same server);
- PyTorch DCP with ``FsspecWriter``/``FsspecReader`` over s3fs (same server),
  with ``sync_files=False`` because ``fsync`` does not exist on S3, at 1 and
  at 8 writer threads.

moto's server runs in its own process (``python -m moto.server``) on
127.0.0.1, so client and server do not share an interpreter lock, with
objects kept in memory. moto answers a ranged GET by materialising the whole
object and slicing it, so on moto a ranged read costs time in proportion to
the object's size, not the range's (real S3 does not); a first row measures
the server's ceiling with one PUT and one GET of the same bytes. Every
load is checked bit-exact. Prints MB/s (best and median of ``--reps``),
the ranged GETs per shardpoint load, and ratios.

Usage::

    python bench/bench_s3.py --mib 256 --reps 3
    python bench/bench_s3.py --mib 256 --reps 3 --only 'shardpoint s3'   # merging on and off only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardpoint as sp  # noqa: E402
from shardpoint.storage import FsspecStorage, S3Options, S3Storage  # noqa: E402

KEY = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    # Keep objects in memory: by default moto spills every object over ~5 MiB to a temporary file.
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(4 << 30))
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def make_model(total_mib: int, layer_mib: int, seed: int) -> nn.Module:
    n = max(1, total_mib // layer_mib)
    side = int((layer_mib * (1 << 20) / 4) ** 0.5)
    torch.manual_seed(seed)
    layers = [nn.Linear(side, side, bias=True) for _ in range(n)]
    return nn.Sequential(*layers)


def nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def zero_(model: nn.Module) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()


def s3_cleanup(client, bucket: str, prefix: str) -> None:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [{"Key": o["Key"]} for o in page.get("Contents", ())]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB")
    ap.add_argument("--layer-mib", type=int, default=32, help="size of each weight matrix in MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8, help="shardpoint S3 threads per process")
    ap.add_argument("--part-mib", type=int, default=16, help="multipart part size")
    ap.add_argument("--read-part-mib", type=int, default=16, help="ranged GET size")
    ap.add_argument("--read-merge-gap", type=int, default=1 << 20,
                    help="merge waiting reads of one object up to this many bytes apart (-1: off)")
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args()

    import boto3
    import s3fs
    from torch.distributed.checkpoint import load as dcp_load, save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    proc, endpoint = start_moto()
    tmp = tempfile.mkdtemp(prefix="bench_s3_")
    try:
        client = boto3.client("s3", endpoint_url=endpoint, **KEY)
        bucket = "bench"
        client.create_bucket(Bucket=bucket)
        src = make_model(args.mib, args.layer_mib, seed=0)
        dst = make_model(args.mib, args.layer_mib, seed=1)
        size = nbytes(src)
        opts = S3Options(endpoint_url=endpoint, access_key_id="testing", secret_access_key="testing",
                         region="us-east-1", max_concurrency=args.concurrency,
                         part_size=args.part_mib << 20, read_part_size=args.read_part_mib << 20,
                         read_merge_gap=None if args.read_merge_gap < 0 else args.read_merge_gap)
        s3fs_opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                     "client_kwargs": {"region_name": "us-east-1"}}
        fs = s3fs.S3FileSystem(**s3fs_opts)

        def sp_local():
            path = os.path.join(tmp, uuid.uuid4().hex)
            return (lambda: sp.save(path, {"model": src}),
                    lambda: sp.load(path, {"model": dst}),
                    lambda: shutil.rmtree(path, ignore_errors=True))

        gets: dict[str, list[int]] = {}

        def sp_s3(merge: bool = True):
            def make():
                prefix = f"sp/{uuid.uuid4().hex}"
                st = S3Storage(f"s3://{bucket}/{prefix}", opts if merge else replace(opts, read_merge_gap=None))

                def load():
                    before = st.get_requests
                    sp.load(st, {"model": dst})
                    gets.setdefault("on" if merge else "off", []).append(st.get_requests - before)

                return (lambda: sp.save(st, {"model": src}), load,
                        lambda: (s3_cleanup(client, bucket, prefix), st.close()))
            return make

        def sp_bridge():
            prefix = f"br/{uuid.uuid4().hex}"
            st = FsspecStorage(fs, f"{bucket}/{prefix}")
            return (lambda: sp.save(st, {"model": src}),
                    lambda: sp.load(st, {"model": dst}),
                    lambda: s3_cleanup(client, bucket, prefix))

        def dcp_fsspec(threads: int):
            def make():
                prefix = f"dcp/{uuid.uuid4().hex}"
                url = f"s3://{bucket}/{prefix}"

                def save():
                    w = FsspecWriter(url, sync_files=False, thread_count=threads, **s3fs_opts)
                    dcp_save(src.state_dict(), storage_writer=w)

                def load():
                    sd = dst.state_dict()
                    dcp_load(sd, storage_reader=FsspecReader(url, **s3fs_opts))

                return save, load, lambda: s3_cleanup(client, bucket, prefix)
            return make

        probe: list[float] = []

        def raw_boto3():
            # The server's ceiling: one PUT and one GET of the same bytes, no checkpointing.
            blob = bytearray(size)
            off = 0
            for t in src.state_dict().values():
                n = t.numel() * t.element_size()
                blob[off : off + n] = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                off += n
            key = f"raw/{uuid.uuid4().hex}"

            def load():
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
                out = body.read()
                body.close()
                assert len(out) == size
                t = time.perf_counter()
                client.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")["Body"].read()
                probe.append(time.perf_counter() - t)
                dst.load_state_dict(src.state_dict())  # so the bit-exact check below passes

            return (lambda: client.put_object(Bucket=bucket, Key=key, Body=blob), load,
                    lambda: s3_cleanup(client, bucket, key))

        cases = [
            ("boto3 one PUT / one GET (ceiling)", raw_boto3),
            ("shardpoint local", sp_local),
            ("shardpoint s3 (boto3)", sp_s3()),
            ("shardpoint s3 (boto3), merging off", sp_s3(merge=False)),
            ("shardpoint fsspec bridge (s3fs)", sp_bridge),
            ("dcp fsspec s3fs, 1 thread", dcp_fsspec(1)),
            ("dcp fsspec s3fs, 8 threads", dcp_fsspec(8)),
        ]
        results = {}
        if args.only:
            cases = [c for c in cases if args.only in c[0]]
        for name, make in cases:
            saves, loads = [], []
            for _ in range(args.reps):
                save, load, clean = make()
                t0 = time.perf_counter()
                save()
                t1 = time.perf_counter()
                zero_(dst)
                t2 = time.perf_counter()
                load()
                t3 = time.perf_counter()
                if not same(src, dst):
                    raise SystemExit(f"{name}: load is not bit-exact")
                clean()
                saves.append(size / (t1 - t0) / 1e6)
                loads.append(size / (t3 - t2) / 1e6)
            results[name] = {
                "save_best": max(saves), "save_median": statistics.median(saves),
                "load_best": max(loads), "load_median": statistics.median(loads),
            }
            r = results[name]
            print(f"{name:34s} save {r['save_median']:7.1f} MB/s (best {r['save_best']:7.1f})   "
                  f"load {r['load_median']:7.1f} MB/s (best {r['load_best']:7.1f})", flush=True)

        for k, v in gets.items():
            print(f"shardpoint s3, merging {k}: ranged GETs per load {statistics.median(v):.0f} "
                  f"[{min(v)}, {max(v)}]")
        if probe:
            print(f"a 1-byte ranged GET of that {size / 1e6:.0f} MB object takes {statistics.median(probe):.3f} s on moto")
        if args.only:
            return
        s3 = results["shardpoint s3 (boto3)"]
        print(f"\nstate {size / 1e6:.0f} MB, {args.reps} reps, medians; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs")
        for other in ("shardpoint s3 (boto3), merging off", "shardpoint local", "dcp fsspec s3fs, 1 thread",
                      "dcp fsspec s3fs, 8 threads", "shardpoint fsspec bridge (s3fs)"):
            o = results[other]
            print(f"shardpoint s3 / {other:32s} save {s3['save_median'] / o['save_median']:5.2f}x   "
                  f"load {s3['load_median'] / o['load_median']:5.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"state_bytes": size, "reps": args.reps, "results": results, "gets_per_load": gets},
                          f, indent=1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
