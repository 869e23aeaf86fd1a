"""Hugging Face checkpoint I/O for sharded models (autoplan/runtime/hf_checkpoint.py).

Single-process: the safetensors writer (bit-exact round trip through `safetensors`' own reader,
file splitting, index, atomic replacement), the reader (slices, aliases, casts, errors) and the
placement -> slice mapping for FSDP2 over tp. On 4 gloo ranks (slow): tiny GPT-2 and Llama
checkpoints loaded into (dp=2, tp=2) shards and saved back; `from_pretrained` of the result
gives bit-identical parameters and logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DeviceMesh, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import _hf_jobs
from autoplan._torch_compat import local_shard_slices
from autoplan.runtime import hf_checkpoint
from autoplan.runtime.hf_checkpoint import (HFTensor, LoadStats, load_hf_weights, plan_hf_files,
                                            save_hf_weights)

transformers = pytest.importorskip("transformers")


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)


def llama_config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, vocab_size=96,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(gpt2_config()).eval()
    return transformers.LlamaForCausalLM(llama_config()).eval()


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    for k, v in sa.items():
        assert torch.equal(v, sb[k]), k
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(a(x, use_cache=False).logits, b(x, use_cache=False).logits)


# --- placements -> slices -------------------------------------------------------------------

@pytest.mark.parametrize("rows", [8, 10, 7, 3])
def test_strided_shard_is_the_dp_block_of_the_tp_block(rows):
    # FSDP2 over tp: (dp, tp) mesh, tp Shard(0) then dp -> (_StridedShard(0, sf=2), Shard(0)).
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    for rank in range(4):
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False, _rank=rank)
        dp, tp = mesh.get_coordinate()
        tp_block = list(torch.arange(rows).chunk(2)) + [torch.arange(0)] * 2
        block = list(tp_block[tp].chunk(2)) + [torch.arange(0)] * 2
        got = local_shard_slices((rows, 3), mesh, placements)
        assert torch.equal(torch.arange(rows)[got[0]], block[dp]), (rows, rank)
        assert got[1] == slice(0, 3)


def test_non_contiguous_placements_are_refused():
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False, _rank=0)
    with pytest.raises(ValueError, match="not FSDP-over-tp nesting"):
        local_shard_slices((8, 3), mesh, (_StridedShard(0, split_factor=4), Shard(0)))
    with pytest.raises(ValueError, match="Partial"):
        local_shard_slices((8, 3), mesh, (Partial(), Shard(0)))


# --- writer -----------------------------------------------------------------------------------

def test_writer_round_trip_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 7, generator=g), "bf16": torch.randn(3, 4, 2).bfloat16(),
        "f16": torch.randn(9, generator=g).half(), "i64": torch.arange(-6, 6).reshape(3, 4),
        "bool": torch.tensor([True, False, True]), "u8": torch.arange(200, 205, dtype=torch.uint8),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous in memory
    }
    entries = [HFTensor(k, t.shape, t.dtype, 0) for k, t in tensors.items()]
    entries.append(HFTensor("f32_as_bf16", (5, 7), torch.bfloat16, 0))
    save_hf_weights(tmp_path / "out", entries, {**tensors, "f32_as_bf16": tensors["f32"]})
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert set(back) == {e.fqn for e in entries}
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    assert torch.equal(back["f32_as_bf16"], tensors["f32"].bfloat16())
    raw = (tmp_path / "out" / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and json.loads(raw[8:8 + n])["__metadata__"] == {"format": "pt"}
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_plan_hf_files_splits_by_size_and_writer():
    e = lambda name, numel, w=0: HFTensor(name, (numel,), torch.float32, w)  # noqa: E731
    assert plan_hf_files([e("a", 10), e("b", 10)], 80) == [("model.safetensors",
                                                             [e("a", 10), e("b", 10)])]
    plan = plan_hf_files([e("a", 10), e("b", 10), e("c", 100), e("d", 5), e("e", 5, 1),
                          e("f", 5, 1)], 80)
    assert [name for name, _ in plan] == [f"model-0000{k}-of-00004.safetensors"
                                          for k in range(1, 5)]
    assert [[t.fqn for t in g] for _, g in plan] == [["a", "b"], ["c"], ["d"], ["e", "f"]]


def test_save_sharded_files_index_and_config(tmp_path):
    tensors = {f"w{i}": torch.randn(10, 10) for i in range(5)}
    entries = [HFTensor(k, (10, 10), torch.float32, 0) for k in tensors]
    save_hf_weights(tmp_path / "out", entries, tensors, config={"model_type": "toy"},
                    max_shard_bytes=900)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 400
    assert index["weight_map"]["w3"] == "model-00002-of-00003.safetensors"
    for k, name in index["weight_map"].items():
        assert torch.equal(load_file(out / name)[k], tensors[k])
    assert json.loads((out / "config.json").read_text()) == {"model_type": "toy"}
    stats = load_hf_weights(out, {k: torch.empty(10, 10) for k in tensors})
    assert stats == LoadStats(bytes_read=2000, num_tensors=5)


def test_save_replaces_only_when_complete(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    entries = [HFTensor("a", (3,), torch.float32, 0)]

    def fail(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(hf_checkpoint, "_write_tensor", fail)
    with pytest.raises(RuntimeError, match=r"rank 0: writing 'a' to model.safetensors: disk full"):
        save_hf_weights(out, entries, {"a": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["old.txt"]
    monkeypatch.undo()
    save_hf_weights(out, entries, {"a": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["model.safetensors"]
    with pytest.raises(RuntimeError):  # a failed first save creates nothing
        monkeypatch.setattr(hf_checkpoint, "_write_tensor", fail)
        save_hf_weights(tmp_path / "new", entries, {"a": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_save_input_errors(tmp_path):
    a = HFTensor("a", (2, 3), torch.float32, 0)
    with pytest.raises(ValueError, match=r"'a': rank 0 is its writer but holds no piece"):
        save_hf_weights(tmp_path / "o", [a], {})
    with pytest.raises(ValueError, match=r"'a': this rank's tensor has global shape \(3, 2\)"):
        save_hf_weights(tmp_path / "o", [a], {"a": torch.ones(3, 2)})
    with pytest.raises(ValueError, match=r"'a': rank 0 is its source but holds no piece"):
        save_hf_weights(tmp_path / "o", [HFTensor("a", (2, 3), torch.float32, 0, 0)], {})
    with pytest.raises(ValueError, match="source_rank 3 is not in the group"):
        save_hf_weights(tmp_path / "o", [HFTensor("a", (2, 3), torch.float32, 0, 3)],
                        {"a": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="writer_rank 1 is not in the group"):
        save_hf_weights(tmp_path / "o", [HFTensor("a", (2, 3), torch.float32, 1)],
                        {"a": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="appears twice"):
        save_hf_weights(tmp_path / "o", [a, a], {"a": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="complex64 has no safetensors name"):
        HFTensor("z", (2,), torch.complex64, 0)
    assert os.listdir(tmp_path) == []


# --- reader -----------------------------------------------------------------------------------

def test_gpt2_round_trip_single_process(tmp_path):
    model = hf_model("gpt2")
    model.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        fresh = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    fresh.to_empty(device="cpu")
    params = dict(fresh.named_parameters())
    assert "lm_head.weight" in params  # built on meta, the head is not tied: a separate tensor
    stats = load_hf_weights(tmp_path / "hf", params, aliases=_hf_jobs.GPT2_ALIASES)
    assert stats == LoadStats(bytes_read=sum(p.numel() * 4 for p in params.values()),
                              num_tensors=29)
    assert_same_model(model, fresh)
    # the alias also works the other way round
    lm = {"lm_head.weight": torch.empty(96, 32)}
    load_hf_weights(tmp_path / "hf", lm, aliases={"transformer.wte.weight": "lm_head.weight"})
    assert torch.equal(lm["lm_head.weight"], model.lm_head.weight)
    entries = [HFTensor(k, p.shape, p.dtype, 0) for k, p in model.named_parameters()]
    save_hf_weights(tmp_path / "out", entries, params, config=model.config)
    assert_same_model(model, transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out"))


def test_load_sharded_checkpoint_with_cast(tmp_path):
    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    want = model.state_dict()
    params = {k: torch.empty(p.shape, dtype=torch.bfloat16) for k, p in
              model.named_parameters()}
    stats = load_hf_weights(tmp_path / "hf", params)
    assert stats.num_tensors == len(params)
    assert stats.bytes_read == sum(p.numel() * 4 for p in model.parameters())
    for k, p in params.items():
        assert torch.equal(p, want[k].bfloat16()), k
    # slices of a DTensor-free target are whole tensors; a plain 0-d tensor works as well
    save_hf_weights(tmp_path / "s", [HFTensor("s", (), torch.float32, 0)], {"s": torch.tensor(2.)})
    s = {"s": torch.empty(())}
    assert load_hf_weights(tmp_path / "s", s).bytes_read == 4 and s["s"].item() == 2.0


def test_load_errors(tmp_path):
    tensors = {f"w{i}": torch.randn(4, 4) for i in range(3)}
    entries = [HFTensor(k, (4, 4), torch.float32, 0) for k in tensors]
    save_hf_weights(tmp_path / "ok", entries, tensors)
    missing = {f"layer{i}.weight": torch.empty(4, 4) for i in range(10)}
    with pytest.raises(ValueError, match=r"10 parameter\(s\) missing .*'layer7.weight'\] and 2 "
                                         r"more"):
        load_hf_weights(tmp_path / "ok", {**missing, "w0": torch.empty(4, 4)})
    with pytest.raises(ValueError, match=r"shape mismatch for 'w1': file model.safetensors has "
                                         r"'w1' of shape \(4, 4\), the model \(4, 5\)"):
        load_hf_weights(tmp_path / "ok", {"w0": torch.empty(4, 4), "w1": torch.empty(4, 5)})
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    raw = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(raw[:-10])
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*truncated/model"):
        load_hf_weights(truncated, {"w0": torch.empty(4, 4)})
    torch_only = tmp_path / "bin"
    torch_only.mkdir()
    torch.save(tensors, torch_only / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only safetensors checkpoints are supported"):
        load_hf_weights(torch_only, {"w0": torch.empty(4, 4)})
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_weights(tmp_path / "nowhere", {})
    target = torch.zeros(4, 4)
    with pytest.raises(ValueError):  # a failed load leaves the targets untouched
        load_hf_weights(tmp_path / "ok", {"w0": target, "w1": torch.empty(5, 4)})
    assert torch.equal(target, torch.zeros(4, 4))


# --- 4 gloo ranks: (dp=2, tp=2) shards ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family,sharded_input,spread_writers", [
    ("gpt2", False, False), ("llama", True, True)])
def test_sharded_load_and_save_round_trip(clusters, tmp_path, family, sharded_input,
                                          spread_writers):
    model = hf_model(family)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": "20KB"} if sharded_input
                                              else {}))
    max_shard_bytes = 20_000 if spread_writers else 5_000_000_000
    results = clusters.get(4).run(_hf_jobs.load_and_save, family, str(tmp_path / "hf"),
                                  str(tmp_path / "out"), spread_writers, max_shard_bytes,
                                  timeout_s=120)
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], (rank, r["mismatches"])
        assert 0 < r["bytes_read"] < r["file_bytes"] / 2, (rank, r)
    kinds = set(results[0]["kinds"])
    if family == "gpt2":  # every kind of shard the loader has to slice
        assert {"(_StridedShard, Shard)", "(Shard, Shard)", "(Shard, Replicate)", "(Shard)",
                "plain"} <= kinds, kinds
    names = sorted(os.listdir(tmp_path / "out"))
    assert ("model.safetensors.index.json" in names) == spread_writers, names
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    cls = type(model)
    assert_same_model(model, cls.from_pretrained(tmp_path / "out"))


@pytest.mark.slow
def test_sharded_save_failure_leaves_nothing(clusters, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "marker").write_text("old")
    results = clusters.get(4).run(_hf_jobs.failing_saves, str(out), timeout_s=120)
    for rank, r in enumerate(results):
        assert "rank 2: writing 'a' to model-00001-of-00003.safetensors: disk full" in \
            r["write_error"], r
        assert r["after_write_error"] == ["marker"]
        assert "rank 1: entries differ from rank 0's" in r["input_error"], r
        assert r["after_success"] == ["model-00001-of-00003.safetensors",
                                      "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors",
                                      "model.safetensors.index.json"]
        assert r["siblings"] == ["out"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    back = {k: load_file(out / f)[k] for k, f in index["weight_map"].items()}
    assert torch.equal(back["a"], torch.arange(24.0).reshape(8, 3))
    assert torch.equal(back["b"], torch.full((5,), 1.0))  # rank 1 wrote its own copy
    assert back["c"].dtype == torch.bfloat16 and torch.equal(back["c"], torch.ones(2, 2).bfloat16())
