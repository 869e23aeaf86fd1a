"""One point of the search as the whole-step model prices it: the `Config` (mesh, ZeRO stage,
microbatching, schedule, pinned stages) and how its pipeline stages and layers fall on the
pipeline ranks (`config_stages`, `rank_layers`, `rank_shares`). The search (solver/search.py)
makes Configs; step_time.py, rank_memory.py and dp_sync.py price them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autoplan.plan import Stage

__all__ = ["Config", "stages_of", "blocks_text", "config_stages", "rank_layers", "rank_shares"]


@dataclass(frozen=True)
class Config:
    """One point of the outer search (mesh, ZeRO stage, microbatching, schedule)."""

    pp: int
    dp: int
    tp: int
    zero_stage: int
    num_microbatches: int
    microbatch_size: int
    schedule: str
    num_virtual_stages: int = 1
    cp: int = 1
    stage_layers: tuple[int, ...] = ()
    """Blocks per pipeline stage, in stage order, as the user pinned them (`stages=` of
    `plan()`); () for the even split of `stages_of`."""
    ep: int = 1
    """The expert-parallel degree, inside dp (plan.MeshShape.ep; [Note: expert parallelism]
    in cost_model/expert_parallel.py prices it)."""

    @property
    def dp_shard(self) -> int:
        """Ranks that reduce gradients and share ZeRO shards: dp x cp (torchtitan's
        dp_shard x cp FSDP mesh, [Note: context parallelism] in cost_model/context_parallel.py)."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def __str__(self) -> str:
        v = f" v{self.num_virtual_stages}" if self.num_virtual_stages > 1 else ""
        cp = f" x cp{self.cp}" if self.cp > 1 else ""
        cp = (f" (ep{self.ep})" if self.ep > 1 else "") + cp
        stages = (f" (stages of {blocks_text(self.stage_layers)} blocks)"
                  if self.stage_layers else "")
        return (f"pp{self.pp} x dp{self.dp}{cp} x tp{self.tp}, ZeRO-{self.zero_stage}, "
                f"{self.num_microbatches} microbatches of {self.microbatch_size}, "
                f"{self.schedule}{v}{stages}")


def blocks_text(counts) -> str:
    """Blocks per stage in stage order, a run of equal stages as "<blocks>x<stages>":
    (1, 2, 2, 2, 1) -> "1/2x3/1"."""
    runs: list[list[int]] = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "/".join(str(n) if k == 1 else f"{n}x{k}" for n, k in runs)


def stages_of(total_layers: int, num_stages: int) -> tuple[Stage, ...]:
    """Split `total_layers` blocks into `num_stages` contiguous stages, as evenly as possible,
    the first stages taking one more when it does not divide (the last stage carries the head)."""
    if total_layers == 0:
        return tuple(Stage(i, 0, 0) for i in range(num_stages))
    base, extra = divmod(total_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        n = base + (1 if i < extra else 0)
        out.append(Stage(i, start, start + n))
        start += n
    return tuple(out)


def config_stages(cfg: Config, total_layers: int) -> tuple[Stage, ...]:
    """The pipeline stages of `cfg`: its pinned `stage_layers`, else `stages_of`'s even
    split of `total_layers` into pp x v stages."""
    return _stages(cfg.pp * cfg.num_virtual_stages, cfg.stage_layers, total_layers)


def rank_layers(cfg: Config, total_layers: int) -> tuple[int, ...]:
    """Layers per pipeline rank (its v chunks together)."""
    return _layers_per_rank(cfg.pp, cfg.num_virtual_stages, total_layers, cfg.stage_layers)


@functools.lru_cache(maxsize=4096)
def _stages(num_stages: int, stage_layers: tuple[int, ...],
            total_layers: int) -> tuple[Stage, ...]:
    if not stage_layers:
        return stages_of(total_layers, num_stages)
    starts = [sum(stage_layers[:i]) for i in range(len(stage_layers) + 1)]
    return tuple(Stage(i, starts[i], starts[i + 1]) for i in range(len(stage_layers)))


@functools.lru_cache(maxsize=4096)
def _layers_per_rank(pp: int, v: int, total_layers: int,
                     stage_layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    per_rank = [0] * pp
    for st in _stages(pp * v, stage_layers, total_layers):
        per_rank[st.index % pp] += st.num_layers
    return tuple(per_rank)


def _share(part: str, r: int, cfg: Config, layers: list[int], total_layers: int) -> float:
    """Fraction of a part's (weighted total) quantity that rank r holds."""
    if part == "layer":
        return layers[r] / total_layers if total_layers else 0.0
    if part == "pre":
        return 1.0 if r == 0 else 0.0
    return 1.0 if r == cfg.pp - 1 else 0.0


def rank_shares(r: int, cfg: Config, layers, total_layers: int) -> dict[str, float]:
    """`_share` of each part ("pre", "layer", "post") on rank r."""
    return {p: _share(p, r, cfg, layers, total_layers) for p in ("pre", "layer", "post")}
