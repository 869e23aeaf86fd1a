"""Jobs of tests/test_compile.py ([Note: compiled stages] in autoplan/runtime/compiled.py): the
training job of tests/_jobs.py with torch.compile's counters, run with inductor's artifacts in a
directory the tests share."""

from __future__ import annotations

import contextlib
import os

import _jobs


@contextlib.contextmanager
def inductor_cache(path: str | None):
    """TORCHINDUCTOR_CACHE_DIR set to `path` while the job runs (inductor reads it at every
    compilation), as it was after: the tests' ranks share one cache, other jobs keep theirs."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def train_compiled(factory, steps: int, batch: int, overrides: dict, cache_dir: str | None, *,
                   device_memory_bytes: float | None = None):
    """`_jobs.train` (losses, full parameters, plan JSON, gradient norms) with `overrides`,
    and what torch.compile did in this process during it (`compile_counters`, differences)."""
    from autoplan._torch_compat import compile_counters

    before = compile_counters()
    with inductor_cache(cache_dir):
        out = _jobs.train(factory, steps, batch, overrides,
                          device_memory_bytes=device_memory_bytes)
    after = compile_counters()
    return (*out, {k: after[k] - before[k] for k in after})
