"""Read one tensor from a shardpoint checkpoint with only json and numpy.

This is the proof that the format (docs/format.md, versions 1 to 3) needs no
shardpoint and no torch to read: it parses manifest.json, finds each chunk
(listed in the manifest in version 1; in the writers' index files in versions
2 and 3, located by the tensor's grid or holders), reads its bytes, places them
by their box (and flat range), and prints the result. With --verify it also
checks the xxh3_64 block checksums, the index digests (version 2 and later)
and the manifest's own digest (version 3) (needs ``xxhash``).

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


ROW = np.dtype([("key", "<u8"), ("offset", "<u8"), ("nbytes", "<u8"), ("flat_start", "<u8"),
                ("flat_stop", "<u8"), ("nsum", "<u8"), ("ndim", "<u4"), ("flags", "<u4")])


def _safe(folder, name):
    if name.startswith("/") or ".." in name.split("/"):
        raise ValueError(f"unsafe file name {name!r}")
    return os.path.join(folder, name)


def _chunks_v2(folder, m, name, verify):
    """Version 2: every chunk of ``name`` from the index files of the ranks that may hold it."""
    import xxhash

    t = m["tensors"][name]
    if "grid" in t:  # every mesh rank may have written a shard (the arithmetic of section 14.3 narrows it)
        ranks = m["meshes"][t["grid"]["mesh"]]["ranks"]
    else:
        ranks = [r for a, b in t["holders"] for r in range(a, b)]
    # Version 3 binds the key to the dtype too: name, a NUL byte, dtype name.
    raw_key = name.encode("utf-8") + (b"\0" + t["dtype"].encode() if m["format_version"] >= 3 else b"")
    key = xxhash.xxh3_64_intdigest(raw_key)
    for r in sorted(set(ranks)):
        if m["ranks"][r] is None:
            continue
        data_file, index_file, digest = m["ranks"][r]
        with open(_safe(folder, index_file), "rb") as f:
            raw = f.read()
        if verify and xxhash.xxh3_128_hexdigest(raw) != digest:
            raise ValueError(f"{index_file}: digest differs from the manifest")
        if m["format_version"] >= 3:  # the last 16 bytes: xxh3_128 of the rest
            if verify and xxhash.xxh3_128_digest(raw[:-16]) != raw[-16:]:
                raise ValueError(f"{index_file}: does not match its own digest")
            raw = raw[:-16]
        n, nd, ns = (int(v) for v in np.frombuffer(raw, "<u8", 3, 8))
        rows = np.frombuffer(raw, ROW, n, 32)
        dims = np.frombuffer(raw, "<u8", nd, 32 + ROW.itemsize * n)
        sums = np.frombuffer(raw, "<u8", ns, 32 + ROW.itemsize * n + 8 * nd)
        d = s = 0
        for row in rows:
            k = int(row["ndim"])
            if int(row["key"]) == key:
                box = [int(v) for v in dims[d:d + 2 * k]]
                c = {"file": data_file, "offset": int(row["offset"]), "nbytes": int(row["nbytes"]),
                     "offsets": box[:k], "sizes": box[k:],
                     "checksums": [format(int(v), "016x") for v in sums[s:s + int(row["nsum"])]]}
                if int(row["flags"]) & 1:
                    c["flat"] = [int(row["flat_start"]), int(row["flat_stop"])]
                yield c
            d, s = d + 2 * k, s + int(row["nsum"])


def read_tensor(folder, name, verify=False):
    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        text = f.read()
    m = json.loads(text)
    if m.get("format") != "shardpoint" or m.get("format_version") not in (1, 2, 3):
        raise ValueError(f"{folder}: not a shardpoint format version 1, 2 or 3 checkpoint")
    if verify and m["format_version"] >= 3:  # the digest covers every byte before ',"digest":'
        import xxhash

        head = text[: text.rindex(b',"digest":"')]
        if xxhash.xxh3_128_hexdigest(head) != m["digest"]:
            raise ValueError(f"{folder}: manifest.json does not match its own digest")
    t = m["tensors"][name]
    dtype = np.dtype(NUMPY[t["dtype"]])
    out = np.zeros(t["shape"], dtype=dtype)
    chunks = t["chunks"] if m["format_version"] == 1 else _chunks_v2(folder, m, name, verify)
    for c in chunks:
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
