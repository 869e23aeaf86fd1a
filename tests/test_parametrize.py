"""Parametrized weights (torch.nn.utils.parametrize) and random layer skipping.

weight_norm keeps `parametrizations.weight.original0` (g) and `original1` (v) as the parameters
that train and are saved; the weight is computed from them in every forward, which DTensor can
run forward but not backward (no rule for aten._weight_norm_interface_backward), so the planner
replicates it ([Note: composite ops] in autoplan/_torch_compat/sharding_rules.py). Planned runs
match one process (fp32, rtol 1e-5). spectral_norm, which writes its buffers in every forward, is
refused at planning by name; HF LayerDrop (a Python branch on a random draw) is refused at
capture naming the module, the line and the config field to set to 0.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import _parametrize_jobs as jobs
from autoplan import testing
from autoplan.capture import CaptureError, capture

aten = torch.ops.aten
ORIGINALS = {"conv.parametrizations.weight.original0", "conv.parametrizations.weight.original1"}


def test_a_parametrization_list_is_not_the_repeated_blocks():
    """`conv.parametrizations.weight` is a ModuleList with key "0": it was taken for the
    repeated blocks, and installing block 0 failed ("Module has no attribute `0`")."""
    graph = capture(jobs.WeightNormConv(), (torch.randn(4, 32, 10),))
    assert (graph.layer_prefix, graph.num_layers) == ("", 0)
    assert ORIGINALS <= set(graph.params)
    assert graph.params["conv.parametrizations.weight.original0"].shape == (1, 1, 3)


def test_weight_norm_is_offered_replicated_only():
    """DTensor runs aten._weight_norm's piece `_weight_norm_interface` forward only (by its
    decomposition strategy); the trace names the backward op it has no rule for, and
    propagation refuses every placement, so the op is planned all-R and run on local values."""
    from autoplan._torch_compat import Replicate, TensorArg, decompose, propagate_trace, tp_mesh

    v = TensorArg((32, 32, 3), torch.float32, Replicate())
    g = TensorArg((1, 1, 3), torch.float32, Replicate())
    trace = decompose(aten._weight_norm.default, (v, g, 2), {})
    assert trace.backward_without_rule == ("aten._weight_norm_interface_backward.default",)
    with pytest.raises(NotImplementedError, match="_weight_norm_interface_backward"):
        propagate_trace(trace, [Replicate(), Replicate()], tp_mesh(2))
    linear = decompose(aten.linear.default, (TensorArg((4, 8), torch.float32, Replicate()),
                                             TensorArg((6, 8), torch.float32, Replicate())), {})
    assert linear.backward_without_rule == ()


def _check(results, ref, overrides):
    mesh = json.loads(results[0][2])["mesh"]
    assert {axis: mesh[axis] for axis in overrides} == overrides
    for rank, result in enumerate(results):
        assert set(result[1]) == set(ref[1]), rank  # the originals, at their FQNs
        problems = testing.compare(result, ref)
        assert not problems, (rank, problems[:3])


@pytest.mark.slow
@pytest.mark.parametrize("world_size, overrides", [(1, {}), (2, dict(dp=2)), (2, dict(tp=2))],
                         ids=["1-rank", "dp2", "tp2"])
def test_weight_norm_trains_as_one_process(clusters, world_size, overrides):
    batches = jobs.conv_batches(2)
    ref = testing.reference(jobs.WeightNormConv, batches)
    results = clusters.get(world_size).run(
        testing.train_planned, jobs.WeightNormConv, batches, overrides, global_batch=4,
        seq_len=8, timeout_s=300)
    _check(results, ref, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(dp=2), dict(tp=2)], ids=["dp2", "tp2"])
def test_wav2vec2_without_layerdrop_trains_as_one_process(clusters, overrides):
    """Its positional convolution is weight-normalised over dim 2 (filling its g, made as a
    (K,) norm and kept as (1, 1, K), failed); layerdrop 0, dropout 0.1 keyed by sample."""
    pytest.importorskip("transformers")
    batches = jobs.audio_batches(2)
    ref = testing.reference(jobs.wav2vec2(0.0), batches)
    results = clusters.get(2).run(testing.train_planned, jobs.wav2vec2(0.0), batches,
                                  overrides, global_batch=4, seq_len=jobs.AUDIO_FRAMES,
                                  timeout_s=600)
    _check(results, ref, overrides)


def test_layerdrop_is_refused_at_planning_naming_module_line_and_knob():
    pytest.importorskip("transformers")
    from autoplan import autoparallel

    batch = jobs.audio_batches(1)[0]
    model = autoparallel(jobs.wav2vec2(0.1), global_batch=4, example_batch=batch,
                         world_size=2)()
    with pytest.raises(CaptureError, match=(
            r"model\.wav2vec2\.encoder \(Wav2Vec2Encoder\) at `if not skip_the_layer.*"
            r"modeling_wav2vec2\.py:\d+\).* random draw \(`dropout_probability = torch\.rand"
            r".*layerdrop = 0\.1.*set `config\.layerdrop = 0`")):
        _ = model.plan


class _CoinFlip(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if torch.rand([]) < 0.5:  # a random decision in Python
            return x
        return self.proj(x)


def test_a_branch_on_a_random_draw_says_what_to_do():
    with pytest.raises(CaptureError, match=(
            r"in module <root> \(_CoinFlip\) at `if torch.rand\(\[\]\) < 0.5:.*"
            r"test_parametrize.py:\d+\).*random draw.*set the probability of that random "
            r"decision to 0")):
        capture(_CoinFlip(), (torch.randn(4, 8),))


class _OldSpectralNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.utils.spectral_norm(nn.Conv1d(32, 32, 3))
        self.head = nn.Linear(32, jobs.CLASSES)

    def forward(self, x):
        return self.head(self.conv(x).transpose(1, 2))


def _spectral() -> nn.Module:
    model = jobs.WeightNormConv()
    nn.utils.parametrize.remove_parametrizations(model.conv, "weight")
    nn.utils.parametrizations.spectral_norm(model.conv)
    return model


@pytest.mark.parametrize("factory", [_spectral, _OldSpectralNorm], ids=["parametrization",
                                                                        "hook"])
def test_spectral_norm_is_refused_at_planning_by_name(factory):
    from autoplan import autoparallel

    model = autoparallel(factory(), global_batch=4, example_batch=jobs.conv_batches(1)[0],
                         world_size=2)
    with pytest.raises(ValueError, match=r"conv\.weight is spectral-normalised .* \(_u, _v\) "
                                         r".*use weight_norm"):
        _ = model.plan
