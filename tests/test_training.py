"""The correctness contract: training on 4 gloo ranks matches one process, step by step.

Losses of every step and every parameter after 3 AdamW steps agree with a single-process run
of the same model on the same data to rtol 1e-5 / atol 1e-6 (fp32), parameters plus the
per-element [Note: AdamW rounding allowance] of autoplan/testing.py (nonzero only where a
gradient is nearly zero).
The optimizer is AdamW with eps = 1e-6 (see `_jobs.adamw` for why not 1e-8).
"""

from __future__ import annotations

import json

import pytest
import torch

import _jobs

STEPS = 3
BATCH = 4
MESHES = {"dp2xtp2": dict(dp=2, tp=2), "pp2xtp2": dict(pp=2, tp=2),
          "pp2xdp2": dict(pp=2, dp=2)}


def assert_matches(name, result, ref, steps=STEPS):
    """Losses to rtol 1e-5 / atol 1e-6; parameters to the same plus each element's [Note: AdamW
    rounding allowance] (autoplan/testing.py; `_jobs.reference`'s fourth element)."""
    from autoplan.testing import assert_params_close

    ref_losses, ref_params = ref[0], ref[1]
    losses, params = result[0], result[1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)
    assert_params_close(params, ref_params, ref[3] if len(ref) > 3 else None)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = _jobs.reference(_jobs.preset(name), STEPS, BATCH, **kw)
        return cache[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_matches_single_process(clusters, references, name, mesh, zero):
    overrides = dict(MESHES[mesh], zero_stage=zero)
    if "pp" in overrides:
        overrides["num_microbatches"] = 2
    # Under tp, a memory budget below what replication needs makes the planner split weights
    # (with ample memory, replication wins for models this small).
    fraction = 0.9 if "tp" in overrides else None
    budget = _jobs.memory_budget(_jobs.preset(name), BATCH, overrides, fraction, 4)
    results = clusters.get(4).run(_jobs.train, _jobs.preset(name), STEPS, BATCH, overrides,
                                  timeout_s=180, device_memory_bytes=budget)
    if fraction is not None:
        placements = json.loads(results[0][2])["param_placements"]
        assert any(p != "R" for _, p in placements), "the plan split no weight on the tp axis"
    held = set()
    for result in results:
        assert_matches(name, result, references(name))
        held |= set(result[1])
    assert held == set(references(name)[1]), "some parameters are held by no rank"


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp2xtp2", "pp2xdp2"])
def test_zero1_matches_single_process(clusters, references, mesh):
    """ZeRO-1: each dp rank steps the parameters it owns, then one all-gather of the packed
    updates (DTensor shards under tp, tied weights across pipeline stages) restores them all."""
    for plan in _gpt2_tiny_matches(clusters, references, dict(MESHES[mesh], zero_stage=1)):
        assert plan["zero_stage"] == 1


def _gpt2_tiny_matches(clusters, references, overrides):
    """Train gpt2-tiny on 4 ranks under `overrides` (2 microbatches with pp; a memory budget
    that splits weights with tp), check every rank against one process; the ranks' plans."""
    if "pp" in overrides:
        overrides = dict(overrides, num_microbatches=2)
    budget = _jobs.memory_budget(_jobs.preset("gpt2-tiny"), BATCH, overrides,
                                 0.9 if "tp" in overrides else None, 4)
    results = clusters.get(4).run(_jobs.train, _jobs.preset("gpt2-tiny"), STEPS, BATCH,
                                  overrides, timeout_s=180, device_memory_bytes=budget)
    for result in results:
        assert_matches("gpt2-tiny", result, references("gpt2-tiny"))
    return [json.loads(result[2]) for result in results]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("mesh", ["dp2xtp2", "pp2xdp2"])
def test_activation_checkpointing_matches(clusters, references, mesh, policy):
    """Recomputing blocks in backward changes memory, never the numbers."""
    overrides = dict(MESHES[mesh], zero_stage=3, checkpointing=policy)
    for plan in _gpt2_tiny_matches(clusters, references, overrides):
        assert plan["checkpointing"] == policy


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp2xtp2", "pp2xdp2"])
def test_core_attention_checkpointing_matches(clusters, mesh):
    """Megatron-LM's selective recompute ("core-attention") of GPT-2's unfused attention, with
    ZeRO-3 (the cores inside each block's FSDP2 unit) and tp (the cores split by heads):
    every rank matches one process."""
    factory = _jobs.preset("gpt2-tiny", attn_implementation="eager")
    ref = _jobs.reference(factory, STEPS, BATCH)
    overrides = dict(MESHES[mesh], zero_stage=3, checkpointing="core-attention")
    if "pp" in overrides:
        overrides["num_microbatches"] = 2
    budget = _jobs.memory_budget(factory, BATCH, overrides, 0.9 if "tp" in overrides else None, 4)
    results = clusters.get(4).run(_jobs.train, factory, STEPS, BATCH, overrides, timeout_s=180,
                                  device_memory_bytes=budget)
    for result in results:
        assert_matches("gpt2-tiny", result, ref)
        assert json.loads(result[2])["checkpointing"] == "core-attention"


def test_adamw_allowance_covers_near_zero_gradients_only():
    """[Note: AdamW rounding allowance]: an element whose gradient was nearly zero may differ by
    AdamW's amplified rounding noise (1.75e-6 here, as measured); a whole row of ordinary
    elements shifted by 2e-6 (a real difference) still fails, and so does the near-zero
    element shifted 100x further."""
    from autoplan.testing import adamw_allowance, assert_params_close

    g = torch.full((4, 8), 3e-3)
    g[0, 0] = 2.5e-2  # the largest term, the scale of the rounding (GPT-NeoX's, measured)
    g[1, 2] = 1.6e-8  # nearly zero by chance at step 0
    later = torch.full((4, 8), 3e-3)
    allowance = adamw_allowance({"w": [g, later, later]})
    want = torch.zeros(4, 8)
    noisy = want.clone()
    noisy[1, 2] = 1.75e-6
    assert_params_close({"w": noisy}, {"w": want}, allowance)
    shifted = want.clone()
    shifted[3] += 2e-6
    with pytest.raises(AssertionError, match="8 of 32 elements"):
        assert_params_close({"w": shifted}, {"w": want}, allowance)
    far = want.clone()
    far[1, 2] = 1.75e-4
    with pytest.raises(AssertionError, match="1 of 32 elements"):
        assert_params_close({"w": far}, {"w": want}, allowance)
