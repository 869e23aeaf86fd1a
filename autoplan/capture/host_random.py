"""Random draws on the host during capture: refused, naming the module and the source line.

[Note: host random draws]
A forward that draws from Python's `random` or numpy's global generator (`np.random.rand`,
`np.random.choice`, ... or a fresh `np.random.default_rng()`) computes the draw in Python while
torch.export traces it: the value enters the captured graph as a constant, so every step of
every rank would reuse that one draw where one process draws anew each step -- a wrong number,
not an error. HF's SpecAugment is such a draw (wav2vec2, HuBERT, WavLM: `_compute_mask_indices`
with numpy, in training when `config.mask_time_prob` or `mask_feature_prob` is above 0).
torch's own samplers are graph ops and follow the RNG contract ([Note: RNG contract] in
autoplan/passes/rng.py); host draws cannot, so capture refuses them: `host_random_draws`
wraps the samplers of both modules while the trace runs and records the first caller outside
them, and `refusal` words the CaptureError (the running module, the source line, the sampler,
and the config fields to set to 0 where an HF config has them).
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from autoplan.capture.errors import CaptureError

__all__ = ["host_random_draws", "refusal"]

# Python's `random`: its module-level samplers (bound methods of one hidden Random)
_PY_SAMPLERS = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
                "shuffle", "gauss", "normalvariate", "lognormvariate", "expovariate",
                "betavariate", "gammavariate", "triangular", "vonmisesvariate",
                "paretovariate", "weibullvariate", "getrandbits", "randbytes", "binomialvariate")
# config fields of HF models that turn a host-random augmentation on (SpecAugment)
_HF_KNOBS = ("mask_time_prob", "mask_feature_prob")
_SKIP = (random.__file__, __file__)


def _numpy_random():
    try:
        import numpy.random as npr
    except ImportError:  # numpy absent: nothing of it can draw
        return None
    return npr


@contextlib.contextmanager
def host_random_draws(running: list[str]) -> Iterator[list[tuple]]:
    """While the block runs, every sampler of `random` and of numpy's global generator (and
    `np.random.default_rng`) records (sampler, running module FQN or None, filename, line
    number) of its first caller outside them into the yielded list, then draws as before."""
    seen: list[tuple] = []
    npr = _numpy_random()
    skip = _SKIP + ((str(Path(npr.__file__).parent.parent),) if npr is not None else ())
    patched: list[tuple[object, str, object]] = []

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if not callable(original):
            return

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(skip):
                frame = frame.f_back
            site = (frame.f_code.co_filename, frame.f_lineno) if frame else ("?", 0)
            seen.append((label, running[-1] if running else None, *site))
            return original(*args, **kwargs)

        patched.append((owner, name, original))
        setattr(owner, name, recorded)

    for name in _PY_SAMPLERS:
        wrap(random, name, f"random.{name}")
    if npr is not None:
        state = getattr(npr, "mtrand", None)
        legacy = getattr(state, "_rand", None)
        for name in dir(npr):
            value = getattr(npr, name)
            if getattr(value, "__self__", None) is legacy and legacy is not None:
                wrap(npr, name, f"np.random.{name}")
        wrap(npr, "default_rng", "np.random.default_rng")
    try:
        yield seen
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def refusal(draws: list[tuple], model: nn.Module, model_name: str) -> CaptureError:
    """The CaptureError for the host draws `host_random_draws` recorded ([Note: host random
    draws]): the first one's module, source line and sampler, the count, and what to do."""
    label, fqn, filename, lineno = draws[0]
    where = f"{fqn or 'the model'}"
    if fqn is not None:
        where += f" ({type(model.get_submodule(fqn)).__name__})"
    src = linecache.getline(filename, lineno).strip()
    where += f" at `{src}` ({filename}:{lineno})" if src else f" at {filename}:{lineno}"
    knobs = _knobs(model, fqn)
    todo = (f"set {' and '.join(f'`config.{k} = 0`' for k, _ in knobs)} (the model's "
            f"SpecAugment: {', '.join(f'{k} = {v}' for k, v in knobs)})" if knobs else
            "draw with torch instead (dropout-like draws are keyed by sample, [Note: RNG "
            "contract]) or turn the random augmentation off")
    more = f" ({len(draws)} host draws in one forward)" if len(draws) > 1 else ""
    return CaptureError(
        f"cannot capture {model_name!r}: {where}: a random draw on the host ({label}){more}: "
        "its value would be captured as a constant, so every step would reuse one draw where "
        f"one process draws anew; {todo}")


def _knobs(model: nn.Module, fqn: str | None) -> list[tuple[str, float]]:
    """(field, value) of every HF SpecAugment probability above 0 in the configs on the path
    from the root to module `fqn`, each field once."""
    parts = fqn.split(".") if fqn else []
    found: dict[str, float] = {}
    for path in (".".join(parts[:i]) for i in range(len(parts) + 1)):
        config = getattr(model.get_submodule(path), "config", None)
        for name in _HF_KNOBS:
            value = getattr(config, name, None)
            if isinstance(value, (int, float)) and value > 0:
                found.setdefault(name, value)
    return sorted(found.items())
