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

import torch

import _parametrize_jobs as jobs
from autoplan.capture import capture

ORIGINALS = {"conv.parametrizations.weight.original0", "conv.parametrizations.weight.original1"}


def test_a_parametrization_list_is_not_the_repeated_blocks():
    """`conv.parametrizations.weight` is a ModuleList with key "0": it was taken for the
    repeated blocks, and installing block 0 failed ("Module has no attribute `0`")."""
    graph = capture(jobs.WeightNormConv(), (torch.randn(4, 32, 10),))
    assert (graph.layer_prefix, graph.num_layers) == ("", 0)
    assert ORIGINALS <= set(graph.params)
    assert graph.params["conv.parametrizations.weight.original0"].shape == (1, 1, 3)
