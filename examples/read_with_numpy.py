"""Read one tensor from a shardpoint checkpoint with only json and numpy.

This is the proof that the format (docs/format.md, version 1) needs no
shardpoint and no torch to read: it parses manifest.json, reads each chunk's
bytes, places them by their box (and flat range), and prints the result.
With --verify it also checks the xxh3_64 block checksums (needs ``xxhash``).

    python examples/read_with_numpy.py CHECKPOINT_DIR TENSOR_NAME [--verify]
"""

import json
import os
import sys

import numpy as np

# Manifest dtype -> little-endian numpy dtype. bfloat16 and float8 are read as raw bits.
NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2",
         "float8_e4m3fn": "u1", "float8_e5m2": "u1", "int64": "<i8", "int32": "<i4",
         "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?", "complex64": "<c8",
         "complex128": "<c16"}


def read_tensor(folder, name, verify=False):
    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        m = json.load(f)
    if m.get("format") != "shardpoint" or m.get("format_version") != 1:
        raise ValueError(f"{folder}: not a shardpoint format version 1 checkpoint")
    t = m["tensors"][name]
    dtype = np.dtype(NUMPY[t["dtype"]])
    out = np.zeros(t["shape"], dtype=dtype)
    for c in t["chunks"]:
        if c["file"].startswith("/") or ".." in c["file"].split("/"):
            raise ValueError(f"unsafe file name {c['file']!r}")
        with open(os.path.join(folder, c["file"]), "rb") as f:
            f.seek(c["offset"])
            raw = f.read(c["nbytes"])
        if verify:
            import xxhash
            b = m["block_size"]
            sums = [xxhash.xxh3_64_hexdigest(raw[i:i + b]) for i in range(0, len(raw), b)] or [xxhash.xxh3_64_hexdigest(b"")]
            if sums != c["checksums"]:
                raise ValueError(f"{name}: checksum mismatch in {c['file']} at {c['offset']}")
        data = np.frombuffer(raw, dtype=dtype)
        region = out[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"])) + (...,)]  # a view
        if "flat" in c:  # elements [a, b) of the box's row-major order
            a, b = c["flat"]
            whole = region.copy()
            whole.reshape(-1)[a:b] = data
            region[...] = whole
        else:
            region[...] = data.reshape(c["sizes"])
    if t["dtype"] == "bfloat16":  # bfloat16 is the top half of a float32
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out


if __name__ == "__main__":
    x = read_tensor(sys.argv[1], sys.argv[2], verify="--verify" in sys.argv[3:])
    print(f"{sys.argv[2]}: shape {list(x.shape)}, dtype {x.dtype}")
    print("first values:", x.reshape(-1)[:8])
