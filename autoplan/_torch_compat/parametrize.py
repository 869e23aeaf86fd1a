"""torch.nn.utils' weight parametrizations: which weights of a model are spectral-normalised
(the `_SpectralNorm` parametrization of torch.nn.utils.parametrizations.spectral_norm, or the
`SpectralNorm` forward pre-hook of the older torch.nn.utils.spectral_norm)."""

from __future__ import annotations

from torch import nn

__all__ = ["spectral_normalised"]


def spectral_normalised(model: nn.Module) -> list[str]:
    """The FQNs of `model`'s spectral-normalised weights (`conv.weight`), in module order."""
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    found = []
    for path, module in model.named_modules():
        if isinstance(module, _SpectralNorm):  # at <owner>.parametrizations.<weight>.<i>
            owner, _, rest = f".{path}".rpartition(".parametrizations.")
            found.append(f"{owner[1:]}.{rest.split('.')[0]}".lstrip("."))
        found += [f"{path}.{hook.name}".lstrip(".") for hook in
                  module._forward_pre_hooks.values() if isinstance(hook, SpectralNorm)]
    return found
