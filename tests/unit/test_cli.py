"""The ``shardpoint`` command: help, inspect, verify, diff, export/import flags, trace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.cli import build_parser, main
from shardpoint.convert import CheckpointWriter
from shardpoint.geometry import Box

COMMANDS = ("inspect", "verify", "consolidate", "export", "import", "reshard", "diff", "trace")


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "ck")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    sp.save(path, {"model": model, "extra": {"step": 3}}, block_size=256)
    return path


@pytest.fixture
def two_rank(tmp_path):
    """A checkpoint whose tensor ``model.w`` has two chunks written by ranks 0 and 1."""
    path = str(tmp_path / "two")
    w = torch.arange(24.0).view(6, 4)
    with CheckpointWriter(path) as cw:
        cw.add("model.w", w[:3], shape=(6, 4), box=Box((0, 0), (3, 4)), rank=0)
        cw.add("model.w", w[3:], shape=(6, 4), box=Box((3, 0), (3, 4)), rank=1)
        cw.add("model.b", torch.ones(4), rank=1)
        cw.commit()
    return path


def _data_file(path: str) -> str:
    m = sp.read_manifest(path)
    return os.path.join(path, sorted(m.files)[0])


# ------------------------------------------------------------------ help
@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help_with_examples(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Examples:" in out and f"shardpoint {cmd}" in out


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        assert cmd in out
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(COMMANDS)


def test_console_script_runs():
    exe = shutil.which("shardpoint", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the console script is not installed in this environment")
    r = subprocess.run([exe, "verify", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "checksum" in r.stdout


# ------------------------------------------------------------------ inspect
def test_inspect_table_and_json(ckpt, capsys):
    assert main(["inspect", ckpt]) == 0
    out = capsys.readouterr().out
    assert "model.0.weight" in out and "format v3" in out and "extra" in out
    assert main(["inspect", ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == 3 and doc["tensors"]["model.0.weight"]["shape"] == [16, 8]
    assert doc["tensors"]["model.0.weight"]["ranks"] == [0]


def test_inspect_tensor_shows_chunks_and_writers(two_rank, capsys):
    assert main(["inspect", two_rank, "--tensor", "model.w", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["shape"] == [6, 4] and doc["dtype"] == "float32"
    assert [(c["rank"], c["offsets"], c["sizes"]) for c in doc["chunks"]] == [(0, [0, 0], [3, 4]), (1, [3, 0], [3, 4])]
    assert main(["inspect", two_rank, "--tensor", "model.w"]) == 0
    out = capsys.readouterr().out
    assert "2 chunk(s)" in out and "[3, 0]" in out
    assert main(["inspect", two_rank, "--tensor", "model.nope"]) == 2
    assert "no tensor 'model.nope'" in capsys.readouterr().err


def test_inspect_plot_writes_a_png(two_rank, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "map.png")
    assert main(["inspect", two_rank, "--plot", out]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 2000
    assert "2 tensor(s)" in capsys.readouterr().err
    assert main(["inspect", two_rank, "--plot", str(tmp_path / "none.png"), "--keys", "nothing.*"]) == 2


# ------------------------------------------------------------------ verify
def test_verify_intact(ckpt, capsys):
    assert main(["verify", ckpt]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    assert main(["verify", ckpt, "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["problems"] == [] and doc["chunks"] == 4


def test_verify_missing_file(two_rank, capsys):
    files = sorted(f for f in sp.read_manifest(two_rank).files if f.endswith(".bin"))
    os.remove(os.path.join(two_rank, files[1]))
    assert main(["verify", two_rank, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"missing data file {files[1]}" in out
    assert "model.b" in out and "problem(s)" in out


def test_verify_truncated_file(ckpt, capsys):
    f = _data_file(ckpt)
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 10)
    assert main(["verify", ckpt, "-q"]) == 1
    out = capsys.readouterr().out
    assert "is truncated" in out and f"{size - 10} of {size} bytes" in out


def test_verify_bit_flip_names_tensor(ckpt, capsys):
    m = sp.read_manifest(ckpt)
    c = m.tensors["model.1.weight"].chunks[0]
    with open(os.path.join(ckpt, c.file), "r+b") as fh:
        fh.seek(c.offset + 5)
        b = fh.read(1)
        fh.seek(c.offset + 5)
        fh.write(bytes([b[0] ^ 0x10]))
    assert main(["verify", ckpt, "--json", "-q"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and len(doc["problems"]) == 1
    assert "checksum mismatch" in doc["problems"][0] and "model.1.weight" in doc["problems"][0]


# ------------------------------------------------------------------ diff
def test_diff_exit_codes_and_report(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    w = torch.randn(4, 4)
    sp.save(a, {"model": {"w": w, "v": torch.zeros(2)}})
    sp.save(b, {"model": {"w": w + 0.5 * (torch.arange(16).view(4, 4) == 5), "u": torch.zeros(2)}})
    assert main(["diff", a, a]) == 0
    assert "same: 2 tensors" in capsys.readouterr().out
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "model.w" in out and "1/16" in out and "0.5" in out
    assert "only in A (1): model.v" in out and "only in B (1): model.u" in out
    assert main(["diff", a, b, "--json", "--keys", "model.w"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["same"] is False and doc["changed"][0]["max_abs"] == pytest.approx(0.5)
    assert main(["diff", a, b, "--keys", "model.w", "--atol", "0.6", "-q"]) == 0
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ export / import / reshard flags
def test_export_import_quiet_and_errors(ckpt, tmp_path, capfd):
    out = str(tmp_path / "hf")
    assert main(["export", ckpt, "--to", "hf", out, "-q"]) == 0
    assert capfd.readouterr() == ("", "")
    assert main(["export", ckpt, "--to", "hf", out]) == 2
    assert "not empty" in capfd.readouterr().err
    assert main(["export", ckpt, "--to", "hf", out, "--force", "--dtype", "bf16"]) == 0
    assert "exported 4 tensors" in capfd.readouterr().out
    assert main(["export", ckpt, "--to", "dcp", str(tmp_path / "d"), "--shard-size", "1GB"]) == 2
    assert main(["export", ckpt, "--to", "hf", str(tmp_path / "x"), "--dtype", "fp7"]) == 2
    assert "unknown dtype" in capfd.readouterr().err
    assert main(["import", "hf", out, str(tmp_path / "back")]) == 0
    assert "imported 4 tensors" in capfd.readouterr().out
    # the bf16 export differs in dtype, and the values are compared all the same
    assert main(["diff", ckpt, str(tmp_path / "back"), "--keys", "model.*", "--rtol", "0.01", "--json"]) == 1
    doc = json.loads(capfd.readouterr().out)
    assert {t["reason"] for t in doc["changed"]} == {"dtype"} and all(t["n_diff"] == 0 for t in doc["changed"])
    assert doc["changed"][0]["dtype"] == "float32 vs bfloat16" and 0 < doc["changed"][0]["max_rel"] < 0.01


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_import_refuses_pickle_without_trust(ckpt, tmp_path, capfd, fmt):
    out = str(tmp_path / "x")
    assert main(["export", ckpt, "--to", fmt, out, "-q"]) == 0
    assert main(["import", fmt, out, str(tmp_path / "y")]) == 2
    err = capfd.readouterr().err
    assert "--allow-pickle" in err and "pickle" in err
    assert not os.path.exists(tmp_path / "y")
    assert main(["import", fmt, out, str(tmp_path / "y"), "--allow-pickle", "-q"]) == 0


def test_reshard_cli(ckpt, tmp_path, capsys):
    out = str(tmp_path / "r")
    assert main(["reshard", ckpt, "--to-layout", "fsdp:2", out]) == 0
    assert "for fsdp:2 (2 ranks)" in capsys.readouterr().out
    assert main(["inspect", out, "--tensor", "model.0.weight", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["chunks"]
    assert [(r["rank"], r["sizes"]) for r in rows] == [(0, [8, 8]), (1, [8, 8])]
    assert main(["reshard", ckpt, "--to-layout", "zero:2", str(tmp_path / "z")]) == 2
    assert main(["diff", ckpt, out, "-q"]) == 0


def test_trace_command(tmp_path, capsys):
    traces = str(tmp_path / "traces")
    sp.save(str(tmp_path / "ck"), {"w": torch.ones(4)}, trace_dir=traces)
    assert main(["trace", traces, "--merge", str(tmp_path / "all.json")]) == 0
    assert "slowest phases" in capsys.readouterr().out
    assert json.load(open(tmp_path / "all.json"))["traceEvents"]


def test_missing_checkpoint_is_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "CheckpointNotFoundError" in capsys.readouterr().err


def test_import_deepspeed_refuses_without_trust(tmp_path, capsys):
    from shardpoint.cli import main

    rc = main(["import", "deepspeed", str(tmp_path), str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "ConversionError" in err and "without allow_pickle" in err


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Exit status:" in out and "1  verify found damage" in out and "``" not in out and "2  any error" in out
    assert "renamed into place only on success" in out


def test_inspect_shows_references_and_consolidate_makes_a_self_contained_copy(tmp_path, capsys):
    import json as _json

    import torch

    import shardpoint as sp

    st = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.zeros(3)}
    a, b, out = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out")
    sp.save(a, st, block_size=1024)
    st["b"] += 1
    sp.save(b, st, block_size=1024, base=a)
    capsys.readouterr()
    assert main(["inspect", b, "--json"]) == 0
    refs = _json.loads(capsys.readouterr().out)["references"]
    assert [(r["base"], r["files"]) for r in refs] == [("../a", 1)] and refs[0]["bytes"] >= 4096 * 4
    assert main(["inspect", b]) == 0
    assert "in ../a (outside this folder)" in capsys.readouterr().out
    assert main(["consolidate", b, out, "-q"]) == 0
    assert main(["inspect", out, "--json"]) == 0
    assert _json.loads(capsys.readouterr().out)["references"] == []
    assert main(["verify", out]) == 0
