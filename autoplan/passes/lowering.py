"""The lowering: a captured graph, its plan, one rank's mesh coordinates and the options ->
this rank's stage modules (the runtime) or its rewritten stage graphs (an export).

[Note: pass order]
`lower_rank` is the one place the order of the passes is written; the runtime
(runtime/rank_stages.py), the export (passes/export.py `trace_rank`) and the cp trial of
`@autoparallel` (`try_context_parallel`, session.py) all go through it. Each step needs the
one before:
1. a fresh copy of the captured graph (the caller's `CapturedGraph` is never touched), its
   random ops found ([Note: RNG contract]), its weights on meta in the master dtype (the
   runtime's `weights_to_meta`), retargeted to the device (passes/device.py);
2. under cp with pp > 1 (or for every rank of an export), the whole graph checked for an
   attention and a position source (a stage need not hold either, passes/context_parallel.py
   `check_whole_graph`);
3. split into pipeline stages (passes/stages.py); the rank keeps the stages s with
   s % pp == pp_rank, each with Parameter objects of its own (tied weights span stages);
4. the plan's placements: every redistribution explicit (passes/sharding.py); then the plan's
   FP8 linears (passes/float8.py, [Note: float8 recipe]), which run on the placed DTensors;
5. cp: attention over the cp group, the rank's global positions (passes/context_parallel.py)
   -- after the placements, whose redistributions it keeps;
6. the vocab-parallel loss: the last stage returns its logits vocab-sharded ([Note:
   vocab-parallel loss]; tp > 1, pp 1, the token loss, kernels on);
7. expert parallelism: the experts nodes routed over the ep group (the runtime shards their
   weights, runtime/expert_parallel.py);
8. random ops keyed by (seed, step, sample), never the layout ([Note: RNG contract]) -- before
   checkpointing, so that recomputed blocks replay the forward's state; under compile drawn
   eagerly ([Note: compiled stages]);
9. the fused kernels ([Note: kernel fusion]) -- after every rewrite that can cut or replace a
   pattern (a pattern cut by a redistribution stays unfused). Without a runtime only cp comes
   between the placements and the kernels, so at cp 1 an export fuses once, in
   `place_stages`, for the copies of every rank;
10. tp parameters as DTensors (the runtime);
11. each repeated block a called module (passes/blocks.py) -- after the placements and the tp
    parameters: a block takes its redistributions and DTensor parameters with it;
12. compile of the block forwards (the runtime, [Note: compiled stages]) -- inside
    checkpointing, the tp wrapper and the FSDP2 hooks;
13. activation checkpointing (passes/checkpointing.py) -- after the placements: a block's
    redistributions are recomputed with it; a stage without blocks compiled after it;
14. the tp stage forward (local tensors in and out, DTensor inside) and FSDP2 by ZeRO stage
    (the runtime).
An export stops after step 9 (it traces the rewritten graphs; it has no runtime). The runtime's
steps (10, 12, 14, the weights of 1 and 7) are `RankRuntime`'s methods: the compiler packages
never import the runtime (house rule 2).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Protocol

import torch
import torch.fx
import torch.nn as nn

from autoplan.graph import CapturedGraph
from autoplan.passes.blocks import install_blocks
from autoplan.passes.checkpointing import wrap_checkpointing
from autoplan.passes.context_parallel import apply_context_parallel, check_whole_graph
from autoplan.passes.device import retarget_device
from autoplan.passes.experts_local import route_experts
from autoplan.passes.float8 import use_float8
from autoplan.passes.kernels import fuse_kernels, keep_logits_sharded
from autoplan.passes.keyed_random import RandomState, random_ops_eager
from autoplan.passes.rng import make_random_ops_layout_invariant, random_op_indices
from autoplan.passes.sharding import apply_placements, check_redistributions, value_placements
from autoplan.passes.stages import StageGraph, split_stages, untie_across_stages
from autoplan.plan import Plan, Redistribution

__all__ = ["RankCoords", "LoweringOptions", "RankRuntime", "PlacedStages", "LoweredRank",
           "lower_rank", "place_stages", "copy_stage", "try_context_parallel"]


@dataclasses.dataclass(frozen=True)
class RankCoords:
    """One rank's coordinates on the plan's mesh (dp does not change the graphs)."""

    pp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    cp_group: str = ""
    """The name of the rank's cp process group (cp > 1), which the cp attention calls."""


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
    """What the lowering does beyond the plan."""

    device: str | torch.device = "cpu"
    """Where the stage graphs' factory ops create their tensors (passes/device.py)."""
    kernels: bool = True
    """Replace the RMSNorm and SwiGLU patterns with the fused kernels' ops (passes/kernels.py)."""
    compile: bool = False
    """The runtime compiles the stages ([Note: compiled stages]): random ops drawn eagerly,
    selectively checkpointed blocks checkpointed by the compile step."""
    seed: int | None = None
    """The seed of the keyed random ops ([Note: RNG contract]); None: random ops stay as
    captured (an export)."""
    token_loss: bool = False
    """The step's loss is the token cross-entropy ([Note: step loss]): the last stage may return
    vocab-sharded logits."""


class RankRuntime(Protocol):
    """The runtime's steps inside the pass order ([Note: pass order]), implemented by
    runtime/rank_stages.py `RankStages`."""

    experts_op: Callable
    """What an experts node runs under ep > 1 (runtime/expert_parallel.py)."""

    def weights_to_meta(self, gm: torch.fx.GraphModule) -> None:
        """The graph's weights as meta tensors in the master dtype (in place)."""

    def shard_experts(self, gm: torch.fx.GraphModule,
                      routed: list[tuple[torch.fx.Node, torch.fx.Node]]) -> None:
        """The expert weights of `route_experts`' (experts node, weight node) over ep."""

    def distribute_params(self, gm: torch.fx.GraphModule) -> None:
        """The stage's parameters as DTensors with their planned tp placements."""

    def compile_blocks(self, index: int, gm: torch.fx.GraphModule, blocks: list[str]) -> None:
        """Compile the block modules at `blocks` of stage `index`."""

    def compile_flat(self, index: int, gm: torch.fx.GraphModule) -> None:
        """Compile stage `index`, which has no block modules."""

    def tp_forward(self, sg: StageGraph) -> None:
        """The stage's forward with local tensors in and out, DTensor inside."""

    def apply_data_parallel(self, gm: torch.fx.GraphModule, blocks: list[str]) -> nn.Module:
        """The stage under FSDP2 by ZeRO stage; returns the module to run."""


@dataclasses.dataclass
class PlacedStages:
    """Steps 1-4 of [Note: pass order] (`place_stages`), which every rank of an export shares."""

    stages: list[StageGraph]
    """The plan's stage graphs of the asked pp ranks, placements applied."""
    num_stages: int
    stage_param_fqns: dict[int, set[str]]
    """Parameter FQNs of every stage (tied weights span stages), by stage index."""
    options: LoweringOptions
    random_ops: dict
    """Node name -> RandomOp of the graph's random ops (empty when options.seed is None)."""
    planned_nodes: dict[str, torch.fx.Node] | None = None
    """cp > 1: each node's counterpart in the graph captured at the whole sequence."""
    inserted: dict[int, list[Redistribution]] = dataclasses.field(default_factory=dict)
    """The redistributions `apply_placements` inserted, by stage index."""
    kernel_counts: dict[int, dict[str, int]] | None = None
    """`fuse_kernels`' counts by stage where the kernels were fused here (an export at cp 1),
    else None."""
    float8_linears: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    """The weight FQNs of the linears made FP8 linears, by stage index."""


@dataclasses.dataclass
class LoweredRank:
    """This rank's share of the lowering (`lower_rank`)."""

    stage_graphs: list[StageGraph]
    """This rank's stages (rewritten graphs; under a runtime, its modules inside)."""
    modules: list[tuple[int, nn.Module]]
    """(stage index, the module to run) under a runtime; empty for an export."""
    num_stages: int
    stage_param_fqns: dict[int, set[str]]
    random_states: dict[int, RandomState]
    """The keyed random ops' state of each stage that has random ops."""
    kernel_counts: dict[int, dict[str, int]]
    vocab_size: int | None = None
    """The vocabulary the last stage's logits are sharded over (step 6), else None."""
    float8_linears: set[str] = dataclasses.field(default_factory=set)
    """The weight FQNs of this rank's FP8 linears (step 4)."""


def lower_rank(graph: CapturedGraph, plan: Plan, rank: RankCoords, options: LoweringOptions,
               runtime: RankRuntime | None = None, placed: PlacedStages | None = None,
               planned: dict[str, torch.fx.Node] | None = None) -> LoweredRank:
    """The stages of mesh coordinate `rank` lowered from `graph` under `plan`, in the order of
    [Note: pass order]: with `runtime` the modules it trains (on meta: the runtime allocates),
    else the rewritten stage graphs an export traces. `placed`: `place_stages(graph, plan,
    options, planned=...)` shared by several ranks (each rank rewrites a copy; made here when
    None). `planned`: under cp, node name -> its counterpart in the graph captured at the
    whole sequence (passes/expand.py counterparts).

    Raises ValueError where the passes do (a random op the RNG contract cannot key, random ops
    under compile with selective checkpointing, the cp rewrite) and, under a runtime, when the
    inserted redistributions differ from the plan's (`check_redistributions`)."""
    own = placed is None
    if own:
        placed = place_stages(graph, plan, options, runtime, pp_rank=rank.pp_rank,
                              planned=planned)
    out = LoweredRank([], [], placed.num_stages, placed.stage_param_fqns, {},
                      dict(placed.kernel_counts or {}))
    last, produced = placed.num_stages - 1, value_placements(plan)
    inserted, held, unplanned = [], set(), set()
    for sg in placed.stages:
        if sg.index % plan.mesh.pp != rank.pp_rank:
            continue
        sg = sg if own else copy_stage(sg)
        gm = sg.gm
        out.stage_graphs.append(sg)
        inserted += placed.inserted[sg.index]
        out.float8_linears |= placed.float8_linears.get(sg.index, set())
        if plan.mesh.cp > 1:  # 5. attention over the cp group, global positions
            apply_context_parallel(gm, seq_len=plan.seq_len, cp=plan.mesh.cp, rank=rank.cp_rank,
                                   group_name=rank.cp_group, tp=plan.mesh.tp,
                                   planned=placed.planned_nodes, whole=plan.mesh.pp == 1)
        if options.kernels and options.token_loss and sg.index == last:  # 6. sharded logits
            kept = _vocab_parallel_loss(gm, graph, plan, produced)
            if kept is not None:
                unplanned.add(kept)  # the logits' all-gather no longer runs
                out.vocab_size = _vocab_size(graph, kept[0])
        if runtime is not None and plan.mesh.ep > 1:  # 7. experts over the ep group
            runtime.shard_experts(gm, route_experts(gm, runtime.experts_op))
        if placed.random_ops:  # 8. keyed by (seed, step, sample)
            make_random_ops_layout_invariant(gm, placed.random_ops)
            gm.random_state.seed = options.seed
            out.random_states[sg.index] = gm.random_state
            if options.compile:  # drawn eagerly ([Note: compiled stages])
                random_ops_eager(gm)
        # consumers this rank runs (a stage input placeholder named after its producer in an
        # earlier stage is not one)
        held |= {n.meta.get("orig_name", n.name) for n in gm.graph.nodes
                 if n.op == "call_function"}
        if sg.index == last:
            held.add("output")
        if options.kernels and placed.kernel_counts is None:  # 9. (an export at cp 1: done)
            out.kernel_counts[sg.index] = fuse_kernels(gm)
        if runtime is None:  # an export traces the graphs as they are now
            continue
        out.modules.append((sg.index, _stage_module(sg, graph, plan, options, runtime)))
    if runtime is not None:
        # Lint: the redistributions inserted in this rank's stages are exactly the plan's.
        check_redistributions([r for r in plan.redistributions if r.consumer in held
                               and (r.producer, r.consumer) not in unplanned],
                              [r for r in inserted if (r.producer, r.consumer) not in unplanned])
    return out


def _stage_module(sg: StageGraph, graph: CapturedGraph, plan: Plan, options: LoweringOptions,
                  runtime: RankRuntime) -> nn.Module:
    """Steps 10-14 of [Note: pass order]: the stage's rewritten graph as the module the
    runtime trains."""
    gm = sg.gm
    if plan.mesh.tp > 1:  # 10.
        runtime.distribute_params(gm)
    blocks = install_blocks(gm, graph)  # 11.
    if options.compile and blocks:  # 12.
        runtime.compile_blocks(sg.index, gm, blocks)
    # 13. (the compile step checkpoints selectively compiled blocks itself)
    selective_compiled = options.compile and plan.checkpointing == "selective"
    wrap_checkpointing(gm, graph, plan.checkpointing, [] if selective_compiled else blocks)
    if options.compile and not blocks:
        runtime.compile_flat(sg.index, gm)
    if plan.mesh.tp > 1:  # 14.
        runtime.tp_forward(sg)
    return runtime.apply_data_parallel(gm, blocks)


def place_stages(graph: CapturedGraph, plan: Plan, options: LoweringOptions,
                 runtime: RankRuntime | None = None, *, pp_rank: int | None = None,
                 planned: dict[str, torch.fx.Node] | None = None) -> PlacedStages:
    """Steps 1-4 of [Note: pass order] (and 9 for an export at cp 1): the plan's stage graphs
    of pp rank `pp_rank` (None: every stage) with the placements applied. Made once per export:
    for llama3-70b at pp8 x dp2 x tp4, copying, splitting and rewriting the whole 80-layer
    graph again for each of the 32 traced ranks was 40% of the export's time.

    Raises ValueError for a random op the RNG contract cannot key (`random_op_indices`; with
    options.seed), for random ops under compile with selective checkpointing, and where
    `check_whole_graph` does (cp > 1 with pp > 1 or every stage asked for)."""
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    random_ops = {} if options.seed is None else \
        random_op_indices(gm, batch_size=graph.batch_size)
    if random_ops and options.compile and plan.checkpointing == "selective":
        raise ValueError(
            f"compile=True with checkpointing='selective' on a model with random ops "
            f"({len(random_ops)}: {sorted(random_ops)[:3]}...): a selectively checkpointed "
            "block is compiled whole and the random ops run eagerly ([Note: compiled "
            "stages]); plan with checkpointing='full' or 'none', or compile=False")
    if runtime is not None:
        runtime.weights_to_meta(gm)
    retarget_device(gm, options.device)
    # cp rewrites stage by stage below; the stages of every rank (an export) are checked up
    # front at pp 1 too, so that the error comes before any rank's trace
    if plan.mesh.cp > 1 and (plan.mesh.pp > 1 or pp_rank is None):
        check_whole_graph(gm, plan.seq_len, plan.mesh.cp)
    stage_graphs = split_stages(gm, graph, plan.stages)
    param_fqns = {fqn for fqn, p in graph.params.items() if not p.is_buffer}
    placed = PlacedStages(
        [sg for sg in stage_graphs if pp_rank is None or sg.index % plan.mesh.pp == pp_rank],
        len(stage_graphs),
        {sg.index: {n.target for n in sg.gm.graph.nodes
                    if n.op == "get_attr" and n.target in param_fqns} for sg in stage_graphs},
        options, random_ops, planned)
    # without a runtime only cp comes between the placements and the kernels (step 9)
    fuse_here = options.kernels and plan.mesh.cp == 1 and runtime is None
    if fuse_here:
        placed.kernel_counts = {}
    for sg in placed.stages:
        if runtime is not None:  # the stages the runtime trains hold their own Parameters
            untie_across_stages(sg.gm)
        placed.inserted[sg.index] = apply_placements(sg.gm, plan)
        if plan.float8_linears:
            placed.float8_linears[sg.index] = use_float8(sg.gm, frozenset(plan.float8_linears))
        if fuse_here:
            placed.kernel_counts[sg.index] = fuse_kernels(sg.gm)
    return placed


def copy_stage(sg: StageGraph) -> StageGraph:
    """`sg` with a module and graph of its own (an export's trace rebinds the module's
    parameters, the cp rewrite edits the graph); nodes keep their names, meta and tensors are
    shared."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(sg.gm.graph, {}))
    return StageGraph(sg.index, torch.fx.GraphModule(sg.gm, g, class_name=f"Stage{sg.index}"),
                      sg.input_names, sg.output_names)


def _vocab_parallel_loss(gm: torch.fx.GraphModule, graph: CapturedGraph, plan: Plan,
                         produced: dict[str, str]) -> tuple[str, str] | None:
    """Step 6 of [Note: pass order]: the last stage returns its vocab-sharded logits (tp > 1,
    pp 1). Returns the plan's redistribution that no longer runs (an all-gather of the
    logits), or None where nothing changed."""
    if plan.mesh.tp == 1 or plan.mesh.pp > 1:
        return None
    return keep_logits_sharded(gm, graph.main_output_index, produced)


def _vocab_size(graph: CapturedGraph, logits: str) -> int:
    """The vocabulary size: the last dim of captured value `logits` (..., V)."""
    return next(n for n in graph.gm.graph.nodes if n.name == logits).meta["val"].shape[-1]


def try_context_parallel(graph: CapturedGraph, seq_len: int,
                         check_masks_up_to: int | None = None) -> None:
    """Step 5 of [Note: pass order] tried on a copy of the whole planning graph at cp 1, which
    checks its attentions, masks and position source at the planned length (`seq_len` tokens);
    the copy is dropped. `check_masks_up_to`: a mask of more elements is left to the build
    (passes/context_parallel.py). Raises ValueError where `apply_context_parallel` does."""
    trial = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    apply_context_parallel(trial, seq_len=seq_len, cp=1, rank=0, group_name="trial",
                           check_masks_up_to=check_masks_up_to)
