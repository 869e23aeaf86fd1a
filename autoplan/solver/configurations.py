"""The configurations the outer search visits (search.py): the user's choices checked
(`Overrides`, `validate`: numbers that do not divide, stages that do not fit, named), every
valid point of the search enumerated (`PlanConfig`: mesh shape, ZeRO stage, microbatches,
schedule, checkpointing, offload; `enumerate_configs`, `offload_variants`), and the planner's
errors and warnings (`NoFeasiblePlan`, `InvalidConfig`, `ReplicatedWeightsWarning`,
`SolverLimitWarning`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from autoplan.cost_model import offload
from autoplan.cost_model.comm import group_layout
from autoplan.cost_model.config import Config, stages_of
from autoplan.cost_model.expert_parallel import expert_layers
from autoplan.graph import CapturedGraph
from autoplan.options import INTERLEAVED_SCHEDULES, SearchOptions
from autoplan.plan import optimizer_pieces
from autoplan.solver import pins
from autoplan.solver.context import attention_nodes, cp_degrees
from autoplan.solver.expert_degree import ep_degrees, ep_refusal, undominated
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["NoFeasiblePlan", "InvalidConfig", "ReplicatedWeightsWarning", "SolverLimitWarning",
           "Overrides", "PlanConfig", "enumerate_configs", "validate", "offload_variants",
           "balanced_stages", "end_weights", "zero_bubble_refusal"]


class NoFeasiblePlan(ValueError):
    """No configuration fits in device memory; the message gives the smallest per-device memory
    any plan needs, the configuration that needs it and what the device has."""


class InvalidConfig(ValueError):
    """A user override that cannot work (numbers that do not divide, too many stages, ...).

    Attributes:
        reason: what cannot work, naming the numbers.
        option: the boolean keyword argument of `plan()` that would allow it (e.g.
            "allow_tp_across_nodes"), or None. The message ends with "pass <option>=True to
            allow it"; a front end that spells its options otherwise (the command line's
            `--allow-tp-across-nodes`) builds its own message from `reason` and `option`.
    """

    def __init__(self, reason: str, *, option: str | None = None):
        self.reason, self.option = reason, option
        super().__init__(reason if option is None else f"{reason}; pass {option}=True to allow it")


class ReplicatedWeightsWarning(UserWarning):
    """A fixed tp > 1 leaves weight matrices of the repeated block replicated on the tp axis
    because the model's shapes do not split by tp (planner.py, `_warn_unsplit`): every tp rank
    holds them whole."""


class Float8Warning(UserWarning):
    """float8 "on" or "auto" was asked for and the plan runs no linear in FP8 (planner.py
    `_warn_no_float8` says why: no eligible linear, or none where FP8 pays)."""


class SolverLimitWarning(UserWarning):
    """Configurations were skipped because their ILP found no placement within the
    deterministic limit (`time_limit_s`, [Note: deterministic limits] in ilp_types.py): the
    plan is the best of the others. The message names them; a larger limit includes them."""


@dataclass(frozen=True)
class Overrides(SearchOptions):
    """The user's choices of `plan()` (`SearchOptions`: None searched), and what the optimizer
    allows."""

    # False: the optimizer reads whole tensors ([Note: elementwise optimizer] in
    # runtime/optim.py): what hands it pieces of a tensor is not searched
    # (plan.py optimizer_pieces)
    elementwise_optimizer: bool = True
    # False: the stages run through torch.compile, which runs a backward whole (torch 2.13's
    # `_check_torch_compile_compatibility`): the zero-bubble schedule is not searched
    split_backward: bool = True


@dataclass(frozen=True)
class PlanConfig(Config):
    """A point of the outer search: cost_model's Config plus the activation checkpointing policy
    ("none" | "core-attention" | "selective" | "full", [Note: checkpointing]) and the CPU
    offload ("none" | "optimizer" | "optimizer+params", [Note: offload] in cost_model/offload.py);
    cost_model/step_time.py prices them through the Solution and memory forms this module hands
    it. Its placement ILP depends on (tp, b, policy, cp): `costs_key` (not on ep: search.py).
    """

    checkpointing: str = "none"
    offload: str = "none"

    def __str__(self) -> str:
        extra = "" if self.checkpointing == "none" else f", {self.checkpointing} checkpointing"
        extra += "" if self.offload == "none" else f", {self.offload} offloaded"
        return super().__str__() + extra

    @property
    def costs_key(self) -> tuple[int, int, str, int]:
        """(tp, b, policy, cp): what the placement ILP's coefficients depend on."""
        return (self.tp, self.microbatch_size, self.checkpointing, self.cp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, o: Overrides) -> None:
    """Reject overrides that cannot work, naming the numbers (InvalidConfig)."""
    world, layers = topology.world_size, graph.total_layers if graph.num_layers else 0
    for name in ("tp", "pp", "dp", "cp"):
        value = getattr(o, name)
        if value is not None and (value < 1 or world % value):
            raise InvalidConfig(f"{name} {value} does not divide the world size {world}")
    fixed = [v for v in (o.tp, o.pp, o.dp, o.cp) if v is not None]
    prod = 1
    for v in fixed:
        prod *= v
    if world % prod or (len(fixed) == 4 and prod != world):
        raise InvalidConfig(f"tp {o.tp} x pp {o.pp} x dp {o.dp} x cp {o.cp} does not fit "
                            f"world size {world}")
    if o.cp is not None and o.cp > 1:
        _check_cp(graph, spec, o.cp)
    if o.pp is not None and o.pp > max(layers, 1):
        raise InvalidConfig(f"pp {o.pp} is more than the model's {layers} layers")
    if o.tp is not None and o.tp > topology.devices_per_node and not o.allow_tp_across_nodes:
        raise InvalidConfig(f"tp {o.tp} spans nodes of {topology.devices_per_node} devices",
                            option="allow_tp_across_nodes")
    v = o.num_virtual_stages or 1
    if v > 1 and o.schedule not in (None, *INTERLEAVED_SCHEDULES):
        raise InvalidConfig(f"num_virtual_stages {v} needs schedule 'interleaved-1f1b' or "
                            "'interleaved-zb'")
    if o.schedule == "interleaved-zb":
        why = zero_bubble_refusal(o.zero_stage, o.checkpointing, o.split_backward)
        if why is not None:
            raise InvalidConfig(f"schedule 'interleaved-zb' {why}")
    if o.pp is not None and o.pp * v > max(layers, 1):
        raise InvalidConfig(f"pp {o.pp} x num_virtual_stages {v} = {o.pp * v} stages is more "
                            f"than the model's {layers} layers")
    if o.stages is not None:
        _check_stages(o, layers)
    if o.checkpointing not in (None, "none") and not layers:
        raise InvalidConfig(f"checkpointing {o.checkpointing!r} needs repeated blocks; "
                            f"{graph.model_name} has none")
    if o.offload not in (None, "none") and not offload.available(topology):
        raise InvalidConfig(f"offload {o.offload!r}: topology {topology.name!r} gives no host "
                            f"figures (host_mem_bytes, device.host_bw_bytes_per_s, "
                            f"device.host_optimizer_bw_bytes_per_s)")
    if o.offload not in (None, "none") and o.zero_stage is not None:
        try:
            offload.check_offload(o.offload, o.zero_stage, o.dp or 2)
        except ValueError as e:
            raise InvalidConfig(str(e)) from None
    if not o.elementwise_optimizer and o.zero_stage is not None:
        why = optimizer_pieces(o.zero_stage, o.dp or 2, o.cp or 1, o.tp or 1,
                               o.offload or "none")
        if why is not None:
            raise InvalidConfig(
                f"zero_stage {o.zero_stage}: {why}, and the optimizer reads whole tensors "
                "([Note: elementwise optimizer] in runtime/optim.py): its update would not be "
                "the one on whole tensors; use zero_stage 0, 2 or 3 (FSDP2 hands it DTensors) "
                "or an elementwise optimizer (AdamW, Adam, SGD)")
    if o.num_microbatches is not None:
        _check_microbatches(spec, o, world)
    elif o.dp is not None and spec.global_batch % o.dp:
        raise InvalidConfig(f"global_batch {spec.global_batch} is not divisible by dp {o.dp}")


def zero_bubble_refusal(zero_stage: int | None, checkpointing: str | None,
                        split_backward: bool = True) -> str | None:
    """Why the zero-bubble schedule cannot run with these choices (None: it can). It runs a
    microbatch's backward in two passes over one autograd graph, the input gradient and later
    the weight gradient (torch's `stage_backward_input` / `stage_backward_weight`), which
    - torch.compile'd stages cannot (torch 2.13 refuses it);
    - selective checkpointing cannot (torch's selective checkpoint refuses a second backward
      through its region), and full checkpointing would recompute every block twice, a cost
      the planner does not price;
    - ZeRO-3 cannot: FSDP2 takes a block's gradients at its input gradient's post-backward
      hook, and the weight gradient that follows lands in unsharded parameters that the next
      forward reshards (measured: wrong gradients at pp 2 x dp 2)."""
    if not split_backward:
        return ("runs each backward in two halves, which compiled stages cannot (torch 2.13 "
                "refuses it under torch.compile): plan with compile=False or another schedule")
    if checkpointing not in (None, "none"):
        return (f"with checkpointing {checkpointing!r}: its backward runs twice through "
                "every block (input, then weight gradients), which selective checkpointing "
                "refuses and full checkpointing would recompute twice; use checkpointing "
                "'none' or another schedule")
    if zero_stage == 3:
        return ("with ZeRO-3: FSDP2 would reshard a block before its weight gradient is "
                "taken; use zero_stage 0, 1 or 2 or another schedule")
    return None


def _check_stages(o: Overrides, layers: int) -> None:
    """Pinned stages: pp x v of them, at least one block each, the model's blocks in all."""
    v = o.num_virtual_stages or 1
    if o.pp is not None and len(o.stages) != o.pp * v:
        raise InvalidConfig(f"stages {list(o.stages)}: {len(o.stages)} stages for pp {o.pp} x "
                            f"num_virtual_stages {v} = {o.pp * v}")
    if any(not isinstance(n, int) or n < 1 for n in o.stages):
        raise InvalidConfig(f"stages {list(o.stages)}: every stage needs at least one block "
                            "(a count of blocks per stage)")
    if sum(o.stages) != layers:
        raise InvalidConfig(f"stages {list(o.stages)} hold {sum(o.stages)} blocks; the model "
                            f"has {layers}")


def _check_cp(graph: CapturedGraph, spec: TrainingSpec, cp: int) -> None:
    """A fixed cp > 1 needs the sequence in 2 cp chunks and fused attention in every block
    ([Note: context parallelism] in cost_model/context_parallel.py)."""
    if spec.seq_len % (2 * cp):
        raise InvalidConfig(f"cp {cp}: seq_len {spec.seq_len} is not divisible by 2 x cp = "
                            f"{2 * cp} (the load-balanced sequence chunks)")
    if len(attention_nodes(graph)) < max(graph.num_layers or 0, 1):
        raise InvalidConfig(f"cp {cp}: {graph.model_name} has no fused attention op "
                            "(scaled_dot_product_attention) in every block to split the "
                            "sequence around")


def _check_microbatches(spec: TrainingSpec, o: Overrides, world: int) -> None:
    m, b = o.num_microbatches, spec.global_batch
    if m < 1:
        raise InvalidConfig(f"num_microbatches {m} must be >= 1")
    if o.dp is not None:
        dps = [o.dp]
    else:
        rest = world // ((o.tp or 1) * (o.pp or 1) * (o.cp or 1))
        dps = [d for d in _divisors(rest)
               if (o.tp is None or o.pp is None or o.cp is None or d == rest)] or [rest]
    if not any(b % (d * m) == 0 for d in dps):
        d = dps[0] if len(dps) == 1 else min(dps)
        raise InvalidConfig(f"global_batch {b} is not divisible by dp {d} x num_microbatches {m}"
                            + ("" if len(dps) == 1 else f" (nor by any dp in {dps} x {m})"))


def enumerate_configs(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                      o: Overrides, policies: tuple[str, ...] = ("none",),
                      unplaced: list[tuple[str, str]] | None = None) -> list[PlanConfig]:
    """Every configuration the overrides allow ([Note: decomposition], step 1); `policies`:
    the checkpointing policies to search (checkpointing.policies), unless overridden. A mesh
    whose groups cannot sit on the nodes (`_unplaced`) is skipped; `unplaced`, when given,
    receives (mesh, why) per mesh: ("pp 1 x dp 3 x tp 2", "its tp group of 2 ranks ...")."""
    policies = (o.checkpointing,) if o.checkpointing is not None else policies
    world, layers = topology.world_size, graph.total_layers if graph.num_layers else 0
    out = []
    pinned = pins.pinned_params(graph, o.placements)
    ends = end_weights(graph) if o.uneven_stages and o.stages is None and layers else None
    moe = expert_layers(graph)
    refused: dict[str, list[str]] = {}  # a given ep's reason -> the meshes it refuses
    deltas: dict = {}  # expert_degree.undominated's
    for tp in _divisors(world):
        if (o.tp is not None and tp != o.tp) or (
                tp > topology.devices_per_node and not o.allow_tp_across_nodes):
            continue
        if tp == 1 and pins.needs_tp(o.placements):
            continue  # a split pinned: meshes with tp > 1 only
        why = pins.why_not(graph, pinned, tp)
        if why is not None:
            if o.tp is not None:
                raise InvalidConfig(why)
            if unplaced is not None:
                unplaced.append((f"tp {tp}", why))
            continue
        cps = [o.cp] if o.cp is not None else cp_degrees(graph, spec.seq_len, world // tp)
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if (o.pp is not None and pp != o.pp) or (o.dp is not None and dp != o.dp):
                    continue
                if pp > max(layers, 1):
                    continue
                why = _unplaced(tp, dp, pp, topology, cp)
                eps = ep_degrees(moe, dp, tp, cp, topology, o.ep)
                if why is None and not eps:
                    refused.setdefault(ep_refusal(moe, dp, tp, cp, o.ep, topology), []).append(
                        f"pp {pp} x dp {dp} x tp {tp}")
                elif why is None:  # [Note: expert parallelism]: ep searched with the rest
                    out += [replace(c, ep=e) if e > 1 else c
                            for c in _configs_for_mesh(pp, dp, tp, layers, spec, o, policies,
                                                       cp, ends=ends)
                            for e in (undominated(moe, c, eps, spec, topology, deltas)
                                      if moe is not None else eps)]
                elif unplaced is not None:
                    cp_text = f" x cp {cp}" if cp > 1 else ""
                    unplaced.append((f"pp {pp} x dp {dp}{cp_text} x tp {tp}", why))
    if refused and not out:  # a given ep none of the meshes admits
        raise InvalidConfig(f"ep {o.ep}: " + "; ".join(
            f"{why} ({', '.join(meshes[:3])}{', ...' if len(meshes) > 3 else ''})"
            for why, meshes in refused.items()))
    return out


def _unplaced(tp: int, dp: int, pp: int, topology: Topology, cp: int = 1) -> str | None:
    """Why a group of the (pp, dp, cp, tp) mesh -- or the dp x cp gradient group -- does not
    sit evenly on the nodes ([Note: group layout] in cost_model/comm.py), or None when every
    one does."""
    for axis, size, stride in (("tp", tp, 1), ("cp", cp, tp), ("dp", dp, tp * cp),
                               ("dp x cp", dp * cp, tp), ("pp", pp, tp * cp * dp)):
        try:
            group_layout(size, stride, topology)
        except ValueError:
            return (f"its {axis} group of {size} ranks at stride {stride} straddles the "
                    f"{topology.devices_per_node}-device nodes unevenly")
    return None


def _configs_for_mesh(pp, dp, tp, layers, spec, o: Overrides, policies,
                      cp: int = 1, ends: tuple[float, float] | None = None
                      ) -> list[PlanConfig]:
    if spec.global_batch % dp:
        return []
    zeros = [o.zero_stage] if o.zero_stage is not None else (
        [0, 1, 2, 3] if dp * cp > 1 else [0])
    ms = [m for m in _divisors(spec.global_batch // dp)
          if o.num_microbatches is None or m == o.num_microbatches]
    if pp > 1 and o.num_microbatches is None and any(m >= pp for m in ms):
        ms = [m for m in ms if m >= pp]  # fewer microbatches than stages: mostly bubble
    if pp == 1:
        schedules = [(o.schedule or "1f1b", 1)] if o.schedule not in INTERLEAVED_SCHEDULES \
            else []
    else:
        schedules = [(s, 1) for s in ("gpipe", "1f1b") if o.schedule in (None, s)]
        vs = [o.num_virtual_stages] if o.num_virtual_stages else [2]
        if o.schedule in (None, "interleaved-1f1b"):
            schedules += [("interleaved-1f1b", v) for v in vs if v > 1 and pp * v <= layers]
        if o.schedule == "interleaved-zb":  # on request: [Note: zero-bubble time]
            schedules += [("interleaved-zb", v) for v in dict.fromkeys(
                [o.num_virtual_stages] if o.num_virtual_stages else [1, *vs])
                if pp * v <= layers]
    out = []
    for zero in zeros:
        for m in ms:
            for sched, v in schedules:
                if sched in INTERLEAVED_SCHEDULES and m % pp:
                    continue  # the interleaved schedule runs microbatches in rounds of pp
                if sched == "1f1b" and pp > 1 and m < pp:
                    continue  # torch's Schedule1F1B refuses fewer microbatches than stages
                b = spec.global_batch // (dp * m)
                splits = [o.stages] if o.stages else [(), *(
                    [balanced_stages(layers, pp, v, *ends)] if pp > 1 and ends else [])]
                out += [PlanConfig(pp, dp, tp, zero, m, b, sched, v, cp=cp,
                                   stage_layers=split,
                                   checkpointing=policy, offload=o.offload or "none")
                        for split in dict.fromkeys(s for s in splits if s is not None)
                        for policy in policies
                        if sched != "interleaved-zb"
                        or zero_bubble_refusal(zero, policy) is None]
    if o.offload not in (None, "none"):  # a fixed offload: the stages that run it
        out = [c for c in out if o.offload in offload.offloads_for(c.zero_stage, c.dp)]
    if not o.elementwise_optimizer:
        out = [c for c in out
               if optimizer_pieces(c.zero_stage, c.dp, c.cp, c.tp, c.offload) is None]
    return out


# [Note: uneven stages]
# The first pipeline stage also runs what comes before the blocks (the embedding) and the last
# what comes after them (the final norm, the head, the loss): with the blocks split evenly they
# are the slowest stages, and the first, which holds the most microbatches in flight under
# 1F1B, the fullest. Llama 3 405B was trained with one block fewer on each (Dubey et al. 2024,
# "The Llama 3 Herd of Models", sec. 3.3.2: "we reduce one Transformer layer each from the
# first and the last stages"). So the search prices, next to the even split of every pp > 1
# configuration, one uneven split (`balanced_stages`): the blocks dealt one at a time to the
# stage whose pipeline rank's load stays smallest, counting the embedding on the first stage
# and the head on the last as the blocks they weigh (`end_weights`: the larger of their share
# of a block's forward FLOPs and of its parameters, since the end stages are too slow by the
# first and too full by the second). The cost model then prices both splits in full (time,
# bubble, memory per stage) and the search keeps the better one; a split the user pins
# (`stages=`) is the only one priced. A split that takes less than `SPLIT_GAIN` (5%) off the
# heaviest rank is not offered (many blocks per stage: the ends weigh little), so that the
# configurations to bound grow where a split can matter only. The search does this when asked
# (`uneven_stages=True`, `--uneven-stages`): for llama3-405b on 2,048 dgx-h100 nodes (`autoplan
# plan`, batch 2048, 8K tokens) it finds a plan 8% faster (5.38 s a step: 1/2x30/1/2x32
# blocks over pp 32 x 2 chunks, no recomputation, against 5.86 s split evenly with selective
# recomputation) but plans 14% slower (11.2 s against 9.9 s cold, whole process, medians of
# 4 interleaved pairs on this 2-core machine; the harder ILPs of a memory-tight plan and the
# bounds of more configurations), over the planning bar, so it is not the default yet. For
# Llama 3 405B on 16 stages the weights are 0.66 and 0.66 block and the split is 7 / 8 x 14
# / 7, the published one.


def end_weights(graph: CapturedGraph) -> tuple[float, float]:
    """(before, after): what the graph runs before its first repeated block and after its last,
    in blocks ([Note: uneven stages]): for each end, the larger of its forward FLOPs over one
    block's and of the parameters its ops read over one block's (a weight tied across both
    ends counts at both). (0.0, 0.0) for a graph without repeated blocks."""
    if not graph.num_layers or not graph.layer_nodes:
        return 0.0, 0.0
    order = {name: i for i, name in enumerate(graph.nodes)}
    in_blocks = {n for names in graph.layer_nodes.values() for n in names}
    first = min(order[n] for n in in_blocks if n in order)
    last = max(order[n] for n in in_blocks if n in order)
    flops = {"pre": 0.0, "post": 0.0, "block": 0.0}
    for name, info in graph.nodes.items():
        if name in in_blocks:
            flops["block"] += info.flops
        elif order[name] < first:
            flops["pre"] += info.flops
        elif order[name] > last:
            flops["post"] += info.flops
    numel = {"pre": 0.0, "post": 0.0, "block": 0.0}
    for node in graph.gm.graph.nodes:
        info = graph.params.get(node.target) if node.op == "get_attr" else None
        if info is None or info.is_buffer:
            continue
        if info.layer_id is not None:
            numel["block"] += info.numel
            continue
        users = [order[u.name] for u in node.users if u.name in order]
        if any(i < first for i in users):
            numel["pre"] += info.numel
        if any(i > last for i in users):
            numel["post"] += info.numel
    n = graph.num_layers

    def weight(end: str) -> float:
        return max(flops[end] * n / flops["block"] if flops["block"] else 0.0,
                   numel[end] * n / numel["block"] if numel["block"] else 0.0)
    return weight("pre"), weight("post")


SPLIT_GAIN = 0.05
"""The least fraction of the heaviest pipeline rank's load an uneven split must take off for
the search to price it ([Note: uneven stages]): below that it could not win more than that
fraction of the pipeline's time, and each split priced is a configuration more to bound."""


@functools.lru_cache(maxsize=1024)
def balanced_stages(total_layers: int, pp: int, v: int, before: float,
                    after: float) -> tuple[int, ...] | None:
    """Blocks per stage of pp x v stages (stage k on pipeline rank k % pp) when the first
    stage also carries `before` blocks' worth and the last `after` ([Note: uneven stages]):
    every stage one block, then each further block to the stage whose pipeline rank's load
    (its blocks over its v stages, plus the ends' weights) stays the smallest -- on a tie the
    stage with fewer blocks, then the later one (an earlier stage holds more microbatches in
    flight). None when the heaviest rank is not at least `SPLIT_GAIN` lighter than under the
    even split (cost_model.config.stages_of), or when a stage would hold no block."""
    num_stages = pp * v
    if pp < 2 or total_layers < num_stages:
        return None
    extra = [0.0] * pp
    extra[0] += before
    extra[(num_stages - 1) % pp] += after

    def heaviest(split) -> float:
        load = list(extra)
        for k, n in enumerate(split):
            load[k % pp] += n
        return max(load)
    counts = [1] * num_stages
    load = [v + e for e in extra]
    for _ in range(total_layers - num_stages):
        k = min(range(num_stages), key=lambda j: (load[j % pp] + 1, counts[j], -j))
        counts[k] += 1
        load[k % pp] += 1
    even = [st.num_layers for st in stages_of(total_layers, num_stages)]
    return tuple(counts) if heaviest(counts) < (1 - SPLIT_GAIN) * heaviest(even) else None


def offload_variants(cfg: PlanConfig, o: Overrides) -> list[PlanConfig]:
    """The offloaded variants of `cfg` worth searching ([Note: offload] in cost_model/offload.py,
    "Search"): the caller asks for them when no placement of cfg fits on the device; none
    when the offload is fixed (enumerate_configs made those)."""
    if o.offload is not None or cfg.offload != "none":
        return []
    return [replace(cfg, offload=k) for k in offload.offloads_for(cfg.zero_stage, cfg.dp)
            if o.elementwise_optimizer
            or optimizer_pieces(cfg.zero_stage, cfg.dp, cfg.cp, cfg.tp, k) is None]
