"""The expert-parallel degrees ep a mesh admits: those the search adds to its configurations
(search.py: ep searched jointly with the rest, [Note: expert parallelism] in
cost_model/expert_parallel.py prices them), why a given one does not apply, and what the
Search keeps of ep (`ExpertSearch`).
"""

from __future__ import annotations

import dataclasses
import functools

from autoplan.cost_model.comm import group_layout
from autoplan.cost_model.config import Config
from autoplan.cost_model.expert_parallel import (
    ExpertLayers, ep_step_delta_s, expert_layers, expert_slices, expert_weights,
)
from autoplan.cost_model.placement_totals import Solution
from autoplan.cost_model.rank_memory import ExpertSlices
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["ep_degrees", "ep_refusal", "undominated", "delta_key", "ExpertSearch"]


def ep_degrees(layers: ExpertLayers | None, dp: int, tp: int, cp: int, topology: Topology,
               given: int | None) -> list[int]:
    """The expert-parallel degrees of a (dp, tp, cp) mesh the search prices: `given` alone
    when given (none when it does not apply), else 1 and every degree > 1 that applies
    (`ep_refusal`)."""
    if given is not None:
        return [given] if given == 1 or not ep_refusal(layers, dp, tp, cp, given, topology) \
            else []
    if layers is None or cp > 1:
        return [1]
    return [1] + [e for e in range(2, dp + 1)
                  if not ep_refusal(layers, dp, tp, cp, e, topology)]


def ep_refusal(layers: ExpertLayers | None, dp: int, tp: int, cp: int, ep: int,
               topology: Topology) -> str:
    """Why ep > 1 does not apply to the (dp, tp, cp) mesh, or "": the graph has no MoE layer,
    cp > 1 (not planned together), ep does not divide dp or ep x tp some layer's experts
    (tp splits whole experts, [Note: experts over ep and tp] in runtime/expert_parallel.py),
    or its groups straddle node boundaries unevenly (cost_model/comm.py [Note: group
    layout])."""
    if layers is None:
        return "the model has no mixture-of-experts layer"
    if cp > 1:
        return f"with cp {cp}: expert and context parallelism are not planned together"
    bad = sorted({e for e in layers.num_experts if e % ep})
    if bad:
        return (f"does not divide the {'/'.join(map(str, bad))} experts of its MoE layers "
                f"(give an ep that divides them)")
    bad = sorted({e for e in layers.num_experts if e % (ep * tp)})
    if bad:
        return (f"x tp {tp} = {ep * tp} ranks holding disjoint experts (tp splits whole "
                f"experts) does not divide the {'/'.join(map(str, bad))} experts of its MoE "
                f"layers (give a smaller ep or tp)")
    if dp % ep:
        return f"does not divide dp {dp} (fix dp to a multiple of ep)"
    try:  # the ep groups and the groups across them must sit evenly on the nodes
        group_layout(ep, tp, topology)
        group_layout(dp // ep, tp * ep, topology)
    except ValueError as e:
        return str(e)
    return ""


def delta_key(cfg: Config) -> tuple:
    """What expert_parallel.ep_step_delta_s of `cfg` depends on (a cache key)."""
    return (cfg.ep, cfg.pp, cfg.dp, cfg.tp, cfg.zero_stage, cfg.num_microbatches,
            cfg.microbatch_size, cfg.schedule, cfg.num_virtual_stages)


def undominated(layers: ExpertLayers, cfg: Config, eps: list[int], spec: TrainingSpec,
                topology: Topology, seen: dict | None = None) -> list[int]:
    """The degrees of `eps` worth searching for `cfg`: 1 (when in `eps`) and every ep > 1 that
    no larger one dominates. Between two degrees > 1 of one configuration the placements are
    the same (those that split the experts on tp where tp > 1), the step time differs by
    `ep_step_delta_s` (placement-independent) and the memory by the expert slices' states
    alone (rank_memory.ExpertSlices: params and gradients 1 / ep, the optimizer's at most; the
    exchange's buffers do not depend on ep), never more at the larger degree. So a degree whose
    step-time change is no smaller than a larger degree's is never faster and never fits where
    that one does not: it is left out, and the search's optimum is unchanged. `seen`: the
    step-time changes found so far, by what they depend on (kept across the configurations of
    one enumeration)."""
    keep, least = [], float("inf")
    seen = {} if seen is None else seen
    for e in sorted((e for e in eps if e > 1), reverse=True):
        at = dataclasses.replace(cfg, ep=e)
        key = delta_key(at)
        if key not in seen:
            seen[key] = sum(ep_step_delta_s(layers, at, spec, topology))
        delta = seen[key]
        if delta < least:
            keep.append(e)
            least = delta
    return ([1] if 1 in eps else []) + sorted(keep)


class ExpertSearch:
    """What search.Search knows of expert parallelism: the graph's MoE layers, a
    configuration's expert slices and step-time change (kept), and which placements an ep
    configuration runs with. Search supplies `graph`, `spec`, `topology`, `bounds` (its cache)
    and `problem(tp)`."""

    @functools.cached_property
    def moe(self) -> ExpertLayers | None:
        """The graph's MoE layers (cost_model/expert_parallel.py), None without any."""
        return expert_layers(self.graph)

    def expert_slices(self, cfg: Config) -> ExpertSlices | None:
        """How a rank of the ep > 1 configuration `cfg` holds the expert weights
        (rank_memory.ExpertSlices); None at ep = 1."""
        if cfg.ep == 1 or self.moe is None:
            return None
        return expert_slices(self.moe, cfg.ep, cfg.microbatch_size * self.spec.seq_len,
                             self.spec.dtype_bytes, self.spec.routing_skew, cfg.tp)

    def ep_delta(self, cfg: Config) -> tuple[float, float, float]:
        """expert_parallel.ep_step_delta_s of the ep > 1 configuration `cfg`, seconds (kept:
        the bounds and every assessment of cfg ask again)."""
        key = ("ep",) + delta_key(cfg)
        if key not in self.bounds:
            self.bounds[key] = ep_step_delta_s(self.moe, cfg, self.spec, self.topology)
        return self.bounds[key]

    def for_ep(self, cfg: Config, sol: Solution | None) -> Solution | None:
        """`sol`, or None where cfg has ep at tp > 1 and `sol` does not split every expert
        weight on tp (Shard(0)): the runtime's only ep x tp layout ([Note: experts over ep and
        tp] in runtime/expert_parallel.py)."""
        if sol is None or cfg.ep == 1 or cfg.tp == 1:
            return sol
        prob = self.problem(cfg.tp)
        key = ("experts", cfg.tp)
        if key not in self.bounds:
            wanted = set(expert_weights(self.graph))
            self.bounds[key] = [n for n, (fqn, *_x) in prob.params.items() if fqn in wanted]
        split = all(prob.cands[n][sol.choice[n]].outputs[:1] == ("S(0)",)
                    for n in self.bounds[key] if n in sol.choice)
        return sol if split else None
