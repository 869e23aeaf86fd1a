"""The weights' dtype is an input ([Note: dtype of the weights] in
autoplan/runtime/construction.py), and frozen parameters are held in the compute dtype where the
plan says so (`Plan.frozen_dtype`, [Note: precision recipe] in autoplan/runtime/precision.py).

- A bf16 `save_pretrained` checkpoint trains without `dtype=` in bf16 with fp32 masters, equal to
  one process running that recipe from the same files; with `dtype="float32"` in fp32, upcast
  on load, equal to one fp32 process (rtol 1e-5). A checkpoint of several floating dtypes is an
  error asking for `dtype=`.
- Frozen parameters held in bf16: the same losses as fp32-held ones (the compute reads the
  same bf16 values), frozen values bit-identical to their start cast to bf16, half their bytes.

bf16 tolerance, as tests/test_train_as_planned.py's test_bf16_runs_the_planned_recipe states
it: losses atol 1e-3 (near 4.2), fp32 masters atol 1e-2 after the steps; bf16 runs round at
different places than one process (dp shards sum per-shard bf16 matmuls in fp32, tp partial
sums are reduced in bf16).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import _dtype_jobs
import _jobs
from test_training import assert_matches

STEPS, BATCH = 3, 4


def _bf16_checkpoint(path, seed: int = 3):
    """A random llama-tiny saved as `model.to(torch.bfloat16).save_pretrained(path)`."""
    from autoplan.models import build_model

    torch.manual_seed(seed)
    build_model("llama-tiny", device="cpu").to(torch.bfloat16).save_pretrained(path)
    return path


def test_a_model_trains_in_its_parameters_dtype():
    from autoplan.runtime.construction import resolve_dtype

    fp32 = nn.Linear(4, 4)
    assert resolve_dtype(fp32, None, None) == ("float32", "the model's dtype")
    assert resolve_dtype(nn.Linear(4, 4).to(torch.bfloat16), None, None) == (
        "bfloat16", "the model's dtype")
    assert resolve_dtype(nn.Linear(4, 4).half(), "float32", None) == (
        "float32", "as given, cast from the model's float16")
    assert resolve_dtype(fp32, "bfloat16", None) == ("bfloat16", "as given, cast from the "
                                                                  "model's float32")
    assert resolve_dtype(nn.ReLU(), None, None) == ("float32", "the default")
    # fp32 beside one 16-bit dtype (PEFT's fp32 adapters over a bf16 base): that dtype
    adapted = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4).to(torch.bfloat16))
    assert resolve_dtype(adapted, None, None) == (
        "bfloat16", "the model's bfloat16; its 2 float32 tensors kept as float32 masters")
    mixed = nn.Sequential(nn.Linear(4, 4).half(), nn.LayerNorm(4).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"parameters are of several floating dtypes: 2 in "
                                         r"bfloat16 \(1.weight, 1.bias\); 2 in float16 "
                                         r"\(0.weight, 0.bias\); give the dtype to train in"):
        resolve_dtype(mixed, None, None)
    with pytest.raises(ValueError, match="dtype='bf16' is not one of"):
        resolve_dtype(fp32, "bf16", None)


def test_the_checkpoint_headers_say_the_dtype(tmp_path):
    """Read from the safetensors headers, over config.json (set to float32 here)."""
    import autoplan

    src = _bf16_checkpoint(tmp_path / "bf16")
    config = json.loads((src / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    config["dtype"] = "float32"
    (src / "config.json").write_text(json.dumps(config))
    ap = autoplan.from_pretrained(src, global_batch=8, seq_len=32)
    assert (ap.dtype, ap.dtype_origin) == ("bfloat16", "the checkpoint's dtype")
    assert ap.spec.dtype == "bfloat16"
    ap = autoplan.from_pretrained(src, global_batch=8, seq_len=32, dtype="float32")
    assert (ap.dtype, ap.dtype_origin) == ("float32", "as given, cast from the checkpoint's "
                                                      "bfloat16")


def test_a_checkpoint_of_mixed_dtypes_asks_for_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    import autoplan

    src = _bf16_checkpoint(tmp_path / "mixed")
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].half()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"are of several floating dtypes: \d+ in "
                                         r"bfloat16 .*; 1 in float16 \(lm_head.weight\); give "
                                         r"the dtype to train in, dtype=\"bfloat16\""):
        autoplan.from_pretrained(src, global_batch=8, seq_len=32)
    ap = autoplan.from_pretrained(src, global_batch=8, seq_len=32, dtype="bfloat16")
    assert ap.dtype_origin == "as given, cast from the checkpoint's float16"


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{}, dict(dp=2, zero_stage=3)], ids=["1rank", "dp2"])
def test_bf16_checkpoint_trains_in_its_dtype(clusters, tmp_path, mesh):
    """No dtype=: bf16 compute, fp32 masters read from the bf16 file (exact), as one process
    running the recipe from the same files (tolerance: module docstring)."""
    src = str(_bf16_checkpoint(tmp_path / "src"))
    ref = _jobs.reference_mixed(_dtype_jobs.hf_loader(src), STEPS, BATCH, "bfloat16")
    world = mesh.get("dp", 1)
    results = clusters.get(world).run(_dtype_jobs.train_from_checkpoint, src, STEPS, BATCH,
                                      mesh, timeout_s=300)
    for losses, params, held, dtype, origin, line in results:
        assert (dtype, origin, held) == ("bfloat16", "the checkpoint's dtype",
                                         {"torch.float32"})
        assert line.startswith("| dtype | bfloat16 (the checkpoint's dtype): bf16 forward/"
                               "backward, fp32 master weights"), line
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=0,
                                   atol=1e-3)
        for fqn, value in params.items():
            torch.testing.assert_close(value, ref[1][fqn], rtol=0, atol=1e-2)


@pytest.mark.slow
def test_bf16_checkpoint_under_float32_is_upcast_on_load(clusters, tmp_path):
    """dtype="float32": fp32 throughout, equal to one fp32 process loading the same bf16
    files as fp32 (rtol 1e-5)."""
    src = str(_bf16_checkpoint(tmp_path / "src"))
    ref = _jobs.reference(_dtype_jobs.hf_loader(src, torch.float32), STEPS, BATCH)
    results = clusters.get(2).run(_dtype_jobs.train_from_checkpoint, src, STEPS, BATCH,
                                  dict(tp=2, dtype="float32"), timeout_s=300)
    for losses, params, held, dtype, origin, line in results:
        assert (dtype, held) == ("float32", {"torch.float32"})
        assert origin == "as given, cast from the checkpoint's bfloat16"
        assert line.startswith("| dtype | float32 (as given, cast from the checkpoint's "
                               "bfloat16): fp32 weights"), line
        assert_matches("llama-tiny", (losses, params), ref, steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, zero_stage=3), dict(tp=2)], ids=["dp2", "tp2"])
def test_frozen_parameters_held_in_bf16(clusters, mesh):
    """llama-tiny with its embedding and first block frozen, a bf16 plan with
    frozen_dtype="bfloat16": as one process running the recipe (tolerance: module docstring),
    frozen values bit-identical to their start cast to bf16, held in 2 bytes per element
    instead of 4; with frozen_dtype="" (fp32-held) the losses are the same to the bit."""
    factory = _dtype_jobs.partly_frozen()
    ref_losses, ref_params = _jobs.reference_mixed(factory, STEPS, BATCH,
                                                                "bfloat16")
    start = {k: v.detach().to(torch.bfloat16) for k, v in factory().named_parameters()}
    cluster = clusters.get(2)
    held_16 = cluster.run(_dtype_jobs.train_frozen, factory, STEPS, BATCH, mesh, "bfloat16",
                          "bfloat16", timeout_s=300)
    held_32 = cluster.run(_dtype_jobs.train_frozen, factory, STEPS, BATCH, mesh, "bfloat16", "",
                          timeout_s=300)
    for got, fp32_held in zip(held_16, held_32):
        losses, params, held, num_bytes, frozen_numel, recipe, mismatch = got
        assert "frozen ones held in bf16 only" in recipe
        for fqn, dtype in held.items():
            assert dtype == ("torch.bfloat16" if _dtype_jobs._is_frozen(fqn)
                             else "torch.float32"), (fqn, dtype)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0,
                                   atol=1e-3)
        assert losses == fp32_held[0]
        for fqn, value in params.items():
            if _dtype_jobs._is_frozen(fqn):
                assert torch.equal(value, start[fqn]), f"frozen {fqn} moved"
            else:
                torch.testing.assert_close(value, ref_params[fqn], rtol=0, atol=1e-2)
        assert frozen_numel > 0 and fp32_held[3] - num_bytes == 2 * frozen_numel, (
            num_bytes, fp32_held[3], frozen_numel)
        # the check names what is held against a plan that says otherwise
        assert mismatch and "model.embed_tokens.weight: a frozen parameter held in " \
            "torch.bfloat16, the plan holds frozen parameters in torch.float32" in mismatch
        assert fp32_held[6] and "held in torch.float32, the plan holds frozen parameters in " \
            "torch.bfloat16" in fp32_held[6]
