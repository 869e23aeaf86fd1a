"""Jobs for tests/test_hf_checkpoint.py that run on every rank of a 4-rank gloo cluster.

The model is built on meta and sharded by hand the way a (dp=2, tp=2) plan would: tp
placements as DTensors on mesh["tp"], then FSDP2 (`fully_shard` on mesh["dp"]), which turns a
tp Shard(0) into (_StridedShard(0, sf=2), Shard(0)) on the 2-D mesh; some parameters stay
plain, on every rank or (Llama: embedding on ranks 0-1, lm_head on ranks 2-3, like pipeline
stages) on some. Only then is it allocated (`to_empty`), loaded and saved.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoplan.runtime import hf_checkpoint
from autoplan.runtime.hf_checkpoint import HFTensor, load_hf_weights, save_hf_weights

GPT2_ALIASES = {"lm_head.weight": "transformer.wte.weight"}
# Llama's "pipeline stages": which ranks hold these plain parameters (all others: every rank).
LLAMA_HOLDERS = {"model.embed_tokens.weight": (0, 1), "lm_head.weight": (2, 3)}


def _distribute(module: nn.Module, name: str, mesh, placement) -> None:
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(distribute_tensor(p.data, mesh, [placement])))


def _shard_gpt2(model, mesh) -> None:
    tp = mesh["tp"]
    # Conv1D weights are (in, out): column parallel = Shard(1), row parallel = Shard(0).
    for block in model.transformer.h:
        _distribute(block.attn.c_attn, "weight", tp, Shard(1))
        _distribute(block.attn.c_attn, "bias", tp, Shard(0))
        _distribute(block.attn.c_proj, "weight", tp, Shard(0))
        _distribute(block.mlp.c_fc, "weight", tp, Shard(1))
        _distribute(block.ln_1, "weight", tp, Replicate())
        fully_shard(block, mesh=mesh["dp"])
    _distribute(model.transformer.wte, "weight", tp, Shard(0))  # tp only: a 1-D tp DTensor
    fully_shard(model.transformer.ln_f, mesh=mesh["dp"])        # dp only: a 1-D dp DTensor
    # wpe and lm_head.weight stay plain on every rank; lm_head.weight, no longer the same
    # Parameter as wte.weight, is not in the file and loads through its alias.


def _shard_llama(model, mesh) -> None:
    tp = mesh["tp"]
    for layer in model.model.layers:
        for proj in ("q_proj", "k_proj", "v_proj"):
            _distribute(getattr(layer.self_attn, proj), "weight", tp, Shard(0))
        _distribute(layer.self_attn.o_proj, "weight", tp, Shard(1))
        _distribute(layer.mlp.gate_proj, "weight", tp, Shard(0))
        _distribute(layer.mlp.up_proj, "weight", tp, Shard(0))
        _distribute(layer.mlp.down_proj, "weight", tp, Shard(1))
        _distribute(layer.input_layernorm, "weight", tp, Replicate())
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.model.norm, mesh=mesh["dp"])


def _build(family: str, ckpt: str):
    import transformers

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = transformers.AutoConfig.from_pretrained(ckpt)
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    (_shard_gpt2 if family == "gpt2" else _shard_llama)(model, mesh)
    model.to_empty(device="cpu")
    rank = dist.get_rank()
    params = {n: p for n, p in model.named_parameters()
              if family != "llama" or rank in LLAMA_HOLDERS.get(n, range(4))}
    return config, params


def _file_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _placement_kinds(p) -> str:
    if not isinstance(p, DTensor):
        return "plain"
    return "(" + ", ".join(type(q).__name__ for q in p.placements) + ")"


def load_and_save(family: str, ckpt: str, out: str, spread_writers: bool,
                  max_shard_bytes: int) -> dict:
    """Load `ckpt` into the sharded model, compare every parameter's full tensor with the file,
    save it back to `out`. Returns this rank's stats, mismatches and placement kinds."""
    config, params = _build(family, ckpt)
    aliases = GPT2_ALIASES if family == "gpt2" else {}
    stats = load_hf_weights(ckpt, params, aliases=aliases)
    files = _file_tensors(ckpt)
    mismatches = []
    for fqn, p in params.items():  # same DTensor fqns in the same order on every rank
        full = p.full_tensor() if isinstance(p, DTensor) else p
        want = files[fqn] if fqn in files else files[aliases[fqn]]
        if not torch.equal(full, want):
            mismatches.append(fqn)
    # Everything the file holds, in its order (the same on every rank), each tensor written by
    # rank 0 or by a rank that holds it, round robin.
    entries = []
    for i, (fqn, t) in enumerate(files.items()):
        holders = LLAMA_HOLDERS.get(fqn, range(4)) if family == "llama" else range(4)
        writer = holders[i % len(holders)] if spread_writers else holders[0]
        entries.append(HFTensor(fqn, tuple(t.shape), t.dtype, writer))
    save_hf_weights(out, entries, params, config=config, max_shard_bytes=max_shard_bytes)
    return dict(bytes_read=stats.bytes_read, num_tensors=stats.num_tensors,
                file_bytes=sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors")),
                mismatches=mismatches,
                kinds=sorted({_placement_kinds(p) for p in params.values()}))


def failing_saves(out: str) -> dict:
    """Three saves into `out` (which holds a marker file): rank 2 fails to write; rank 1 passes
    different entries; then one that works. Returns the errors seen and what `out` held."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    sharded = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
    local = {"a": sharded, "b": torch.full((5,), float(rank)), "c": torch.ones(2, 2)}
    entries = [HFTensor("a", (8, 3), torch.float32, 2), HFTensor("b", (5,), torch.float32, 1),
               HFTensor("c", (2, 2), torch.bfloat16, 2)]
    result = {}

    def fail(*args, **kwargs):
        raise OSError("disk full (injected)")

    real = hf_checkpoint._write_tensor
    if rank == 2:
        hf_checkpoint._write_tensor = fail
    try:
        save_hf_weights(out, entries, local, max_shard_bytes=100)
    except RuntimeError as e:
        result["write_error"] = str(e)
    finally:
        hf_checkpoint._write_tensor = real
    result["after_write_error"] = sorted(os.listdir(out))
    bad = entries if rank != 1 else entries[:2]
    try:
        save_hf_weights(out, bad, local)
    except ValueError as e:
        result["input_error"] = str(e)
    save_hf_weights(out, entries, local, max_shard_bytes=100)
    result["after_success"] = sorted(os.listdir(out))
    result["siblings"] = sorted(p.name for p in Path(out).parent.iterdir())
    return result
