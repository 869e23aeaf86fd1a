"""[Note: host random draws] (autoplan/capture/host_random.py): a forward that draws from Python's
`random` or numpy's generator would have its draw captured as a constant -- every step reusing
one draw -- so capture refuses it, naming the module, the line and what to do."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from autoplan.capture import CaptureError, capture


def _np_coin():
    return np.random.rand()


def _py_coin():
    return random.random()


class _Drawn(nn.Module):
    """Scales its output by a coin tossed on the host (numpy or Python's random)."""

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler
        self.proj = nn.Linear(4, 4)
        self.bias_at_init = float(np.random.rand())  # at construction: not a step's draw

    def forward(self, x):
        keep = self.sampler() < 0.5
        return self.proj(x) * float(keep)


@pytest.mark.parametrize("sampler, label, line", [
    (_np_coin, "np.random.rand", "return np.random.rand()"),
    (_py_coin, "random.random", "return random.random()")])
def test_a_host_draw_in_forward_is_refused_naming_its_line(sampler, label, line):
    with pytest.raises(CaptureError) as e:
        capture(_Drawn(sampler), (torch.randn(2, 4),), model_name="drawn")
    text = str(e.value)
    assert f"the model (_Drawn) at `{line}` (" in text and "test_host_random.py" in text
    assert f"a random draw on the host ({label})" in text and "would reuse one draw" in text
    # the samplers are themselves again afterwards
    assert np.random.rand.__self__ is np.random.mtrand._rand
    assert random.random.__self__ is random._inst


def test_no_draw_in_forward_captures():
    g = capture(_Drawn(lambda: 0.0), (torch.randn(2, 4),), model_name="drawn")
    assert g.params


def test_hf_spec_augment_names_its_config_fields():
    """wav2vec2's SpecAugment (numpy, `mask_time_prob` > 0, in training): refused naming
    `config.mask_time_prob = 0`; with it at 0 the same model captures."""
    pytest.importorskip("transformers")
    from autoplan.models.architectures import build_architecture, example_batch

    batch = example_batch("wav2vec2", batch=4, seq_len=16, device="meta")
    model = build_architecture("wav2vec2", mask_time_prob=0.05, mask_time_length=2)
    with pytest.raises(CaptureError, match=r"wav2vec2 \(Wav2Vec2Model\) at `.*np\.random.*`"
                                           r".*set `config\.mask_time_prob = 0`"):
        capture(model.train(), (), example_kwargs=batch, model_name="wav2vec2")
    capture(build_architecture("wav2vec2").train(), (), example_kwargs=batch,
            model_name="wav2vec2")
