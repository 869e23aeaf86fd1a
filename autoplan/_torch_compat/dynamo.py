"""What torch.compile did in this process (torch._dynamo's private counters).
"""

from __future__ import annotations

__all__ = ["compile_counters"]


def compile_counters() -> dict[str, int]:
    """What torch.compile did in this process so far (torch._dynamo's counters): `graphs`
    (FX graphs handed to the backend, one per compiled region; a graph break makes two),
    `graph_breaks` (places a region was cut; the cut ops ran eagerly), `recompiles`
    (guards that failed and compiled a frame again) and `cache_hits` (graphs inductor read
    from its FX graph cache, TORCHINDUCTOR_CACHE_DIR, instead of compiling them). For the
    tests and benchmarks of
    [Note: compiled stages] (autoplan/runtime/compiled.py)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values())),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"])}
