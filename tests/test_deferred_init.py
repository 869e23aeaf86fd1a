"""Deferred initialisation (autoplan/runtime/deferred_init.py): a factory recorded on the meta
device and replayed gives exactly the weights of `torch.manual_seed(s); factory()` on one
process ([Note: RNG contract for initialisation]), including the torch.nn.init functions that
skip meta tensors ([Note: init functions that skip meta]): `trunc_normal_`'s rejection
sampler, `orthogonal_`, `sparse_`, `dirac_`, as HF vision models' `_init_weights` call them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.runtime.deferred_init import module_tensors, module_views, record, replay

SEED = 11


def _replayed(factory) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(one process's state dict, the replay of the recorded factory's), same seed."""
    torch.manual_seed(SEED)
    want = {k: v.detach().clone() for k, v in factory().state_dict().items()}
    torch.manual_seed(SEED)
    model, trace = record(factory)
    got: dict[str, torch.Tensor] = {}
    replay(trace, module_tensors(model), lambda name, t: got.__setitem__(name, t.clone()),
           views=module_views(model))
    return want, got


def _assert_equal(want: dict, got: dict) -> None:
    assert set(got) == set(want), sorted(set(want) ^ set(got))
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"replayed values differ from one process: {differ}"


class _Inits(nn.Module):
    """Parameters made in __init__ and overwritten by every init that skips meta, then a
    normal_ whose numbers come after a data-dependent count of draws."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 64))
        self.table = nn.Parameter(torch.randn(200, 64))
        self.rotation = nn.Parameter(torch.empty(16, 24))
        self.sparse = nn.Parameter(torch.empty(12, 10))
        self.conv = nn.Conv2d(4, 4, 3)
        self.after = nn.Parameter(torch.empty(32))
        # std 1 within +-2 std: ~4.6% of the draws are rejected and drawn again, so how many
        # numbers trunc_normal_ takes depends on the values (a meta tensor cannot know them)
        nn.init.trunc_normal_(self.table, std=1.0)
        nn.init.trunc_normal_(self.token, std=0.02)
        nn.init.orthogonal_(self.rotation)
        nn.init.sparse_(self.sparse, sparsity=0.3)
        nn.init.dirac_(self.conv.weight)
        nn.init.normal_(self.after)


def test_init_functions_that_skip_meta_replay_as_one_process():
    want, got = _replayed(_Inits)
    _assert_equal(want, got)
    assert want["token"].std() < 0.05 and want["table"].abs().max() <= 2.0


def test_recording_leaves_torch_and_transformers_functions_as_they_were():
    before = {n: getattr(torch.nn.init, n) for n in ("trunc_normal_", "orthogonal_", "dirac_")}
    record(_Inits)
    assert {n: getattr(torch.nn.init, n) for n in before} == before
    hf = pytest.importorskip("transformers.initialization")
    assert not [n for n, f in hf.TORCH_INIT_FUNCTIONS.items()
                if hasattr(f, "__autoplan_init_call__")]


def _vision(name: str):
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, image_size=32, patch_size=8)
    config, cls = {"vit": ("ViTConfig", "ViTForImageClassification"),
                   "deit": ("DeiTConfig", "DeiTForImageClassification"),
                   "dinov2": ("Dinov2Config", "Dinov2Model")}[name]
    config = getattr(transformers, config)(**small)
    return lambda: getattr(transformers, cls)(config)


@pytest.mark.parametrize("name", ["vit", "deit", "dinov2"])
def test_hf_init_weights_overwriting_init_tensors_replays_as_one_process(name):
    """HF `_init_weights` overwrites `cls_token` / `position_embeddings` (a `torch.randn` of
    `__init__`) and the linear weights with `trunc_normal_` (std 0.02)."""
    want, got = _replayed(_vision(name))
    _assert_equal(want, got)
    token = next(v for k, v in got.items() if k.endswith("embeddings.cls_token"))
    assert token.std() < 0.05, "cls_token kept its construction value (std 1)"


class _Views(nn.Module):
    """weight_norm's g (`conv.parametrizations.weight.original0`, (1, 1, 3)) is made as a norm
    of shape (3,) and viewed; `t` is the transpose of a tensor made (3, 5)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 8, 3), dim=2)
        self.t = nn.Parameter(torch.randn(3, 5).t())


def test_a_tensor_made_in_another_view_replays_as_its_module_views_it():
    want, got = _replayed(_Views)
    _assert_equal(want, got)
    assert got["conv.parametrizations.weight.original0"].shape == (1, 1, 3)
    assert got["t"].shape == (5, 3)
