"""Activation checkpointing as a dimension of the search: what a policy does to the placement
ILP's time coefficients and to a configuration's memory.

[Note: checkpointing] The policies are the Plan's `checkpointing`, one for every stage (the
runtime wraps each repeated block, autoplan/passes/checkpointing.py):

- "none": autograd keeps every tensor it saves (cost_model.activations, [Note: saved tensors]).
- "selective": op-level selective checkpointing as the runtime runs it (torch's selective
  checkpoint contexts, autoplan/passes/checkpointing.py): a block keeps the outputs of its
  matmuls, whatever their aten spelling (linear, mm, addmm, bmm, matmul), and of fused
  attention (`SELECTIVE_SAVED`: autoplan.op_classes.SELECTIVE_SAVED_OPS, the one list the
  runtime's policy runs, [Note: selective saved set]) and its input; its other ops run their
  forward again in the backward. (Korthikanti et al. 2022,
  section 5, drop only the attention scores; cost_model.memory keeps that published variant
  for its formula checks.)
- "core-attention" ([Note: core attention]): Megatron-LM's selective recompute (Korthikanti et
  al. 2022, section 5; `--recompute-granularity selective`). Each attention core of unfused
  attention -- the score matmul q @ k^T and what its value reaches up to the matmul with v:
  scale, mask, softmax, dropout (cost_model.activations.core_attention_regions) -- runs under
  checkpointing of its own (autoplan/passes/checkpointing.py); the block's other ops save what
  they save without checkpointing. Dropped: the saved tensors the cores own and only core ops
  save (`Problem.core_saved`: the scores, probabilities, dropout mask and output, the 5 a s^2 b
  term of Korthikanti's Table 2); added: what a core reads that no op saves (an additive mask,
  `Problem.core_inputs`), which its checkpoint holds; recomputed: the cores' forward (two
  batched matmuls and the pointwise ops between). The transient of a block's backward is its
  cores' saved bytes at the chosen placement (`block_bytes`). Fused attention (sdpa, flash)
  has no core and is not offered the policy.
- "full": a block keeps only its input -- the residual stream entering it, priced at its global
  size, i.e. replicated on the tp axis -- and its whole forward, redistributions included, runs
  again in its backward (Chen et al. 2016; Korthikanti et al. 2022, section 4).

Time. The recomputed nodes' forward compute (cost_model.compute.op_time_s at the candidate's
shard factor) is added to their ILP compute coefficient, and the forward redistribution of
every edge into a recomputed node is added to that edge's backward time (`checkpointed_costs`),
which no longer pays the all-gather again of a gathered input held as its shard ([Note:
regather priced] in solver/costs.py): the recomputed forward gathers it.
The placement ILP therefore prices recomputation exactly, with its form unchanged.

Memory of pipeline rank r, with f_r microbatches in flight and L_r of the T blocks:

    none       f_r (L_r / T) A                          (A: saved bytes of all T blocks)
    core-attn  f_r (L_r / T) (A - C + H) + C_1          (C: what only the cores save, H: what
                                                         their checkpoints hold besides, C_1:
                                                         one block's C at its placement)
    selective  f_r (L_r / T) K + f_r L_r I_q + A_1      (K: kept outputs of all T blocks;
                                                         I_q: one block's input at the
                                                         placement q of the block output;
                                                         A_1: one block's saved bytes,
                                                         rematerialised, replicated)
    full       f_r L_r I + A / T                        (I: one block's input; A / T: one
                                                         block's activations, rematerialised
                                                         during its backward)

plus what is outside the blocks (embedding, head: never checkpointed). For the ILP these are
changes to `RankMemory` (`checkpointed_ranks`: for "full" the block activations' coefficient
becomes 1 / T and f_r L_r I is a constant); for a solved placement, changes to the Solution's
activation totals and a transient at every moment of a rank that holds blocks but the last
rank's loss (`checkpointed_solution`; cost_model/rank_memory.py rank_peak).
Under "selective", I_q is a placement term: T x I / tp is added to the activation row of the
block-output node (`boundary_node`) for its S(d) candidates and T x I for the others, so a
residual stream split on the sequence dim ([Note: sequence parallelism] in solver/sequence.py)
keeps 1/tp of each block input, as Korthikanti et al. 2022 (Table 2, "selective + sequence
parallelism": 34 sbh / t) count it. Under "full" I stays replicated (a constant).
"""

from __future__ import annotations

import dataclasses

from autoplan.cost_model.compute import at_tokens, module_input_bytes, op_time_s
from autoplan.cost_model.placement_totals import RankMemory, Solution
from autoplan.op_classes import SELECTIVE_SAVED_OPS
from autoplan.solver.costs import Costs, out_divisor
from autoplan.solver.problem import Problem, boundary_bytes, boundary_node
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["POLICIES", "SELECTIVE_SAVED", "policies", "recomputed_nodes", "checkpointed_costs",
           "checkpointed_ranks", "checkpointed_solution", "block_bytes",
           "boundary_node", "boundary_bytes"]

POLICIES = ("none", "core-attention", "selective", "full")

SELECTIVE_SAVED = SELECTIVE_SAVED_OPS
"""aten base names whose outputs "selective" keeps: autoplan.op_classes.SELECTIVE_SAVED_OPS
([Note: selective saved set]), the list the runtime's policy (passes/checkpointing.py) runs:
every matmul spelling (linear, mm, addmm, bmm, matmul, ...) and fused attention."""


def policies(problem: Problem) -> tuple[str, ...]:
    """The policies worth searching: checkpointing needs repeated blocks (nothing else is
    checkpointed); "core-attention" needs attention cores (unfused attention)."""
    if not problem.num_layers:
        return ("none",)
    return tuple(p for p in POLICIES if p != "core-attention" or problem.core_saved)


def recomputed_nodes(problem: Problem, policy: str) -> set[str]:
    """ILP nodes whose forward runs again in the backward under `policy`."""
    block = {n for n in problem.nodes if problem.part[n] == "layer" and n in problem.graph.nodes}
    if policy == "full":
        return block
    if policy == "selective":
        return block - {owner for owner, *_x in problem.kept_selective}
    if policy == "core-attention":
        return block & problem.core_nodes
    return set()


def checkpointed_costs(problem: Problem, costs: Costs, policy: str, spec: TrainingSpec,
                       topology: Topology) -> Costs:
    """`costs` with the recomputation of `policy` folded in (see the module docstring); for
    "selective" the block nodes' activation rows become the outputs they keep."""
    nodes = recomputed_nodes(problem, policy)
    if not nodes:
        return costs
    compute = dict(costs.compute_s)
    fx_nodes = {node.name: node for node in problem.graph.gm.graph.nodes}
    for n in nodes & compute.keys():
        info = problem.graph.nodes[n]
        scaled = at_tokens(info, costs.scale, module_input_bytes(fx_nodes[n]))
        fp8 = costs.float8_forward_s.get(n) or [None] * len(compute[n])
        compute[n] = [t + (op_time_s(scaled, topology.device, spec.dtype,
                                     shard_factor=c.shard_factor,
                                     routing_skew=spec.routing_skew) if f is None else f)
                      for t, c, f in zip(compute[n], problem.cands[n], fp8)]
    # A gather into a checkpointed block runs again in its recomputation (under "selective"
    # also into the kept matmuls: the replay gathers their input before the cache answers),
    # and the held-shard all-gather again ([Note: regather priced] in solver/costs.py) is
    # then not paid: the checkpoint, not autograd, holds what the block saves.
    replayed = (lambda e: problem.part.get(e.dst) == "layer") if policy in ("selective",
                                                                             "full") \
        else (lambda e: e.dst in nodes)
    pairs = [{key: (fwd, bwd + fwd - costs.regather_s.get(i, {}).get(key, 0.0), name)
              for key, (fwd, bwd, name) in row.items()}
             if edge.dst in nodes or (i in costs.regather_s and replayed(edge)) else row
             for i, (edge, row) in enumerate(zip(problem.edges, costs.pairs))]
    # context parallelism's K/V all-gather runs again with attention's recomputed inputs
    # under both policies ([Note: context parallelism] in cost_model/context_parallel.py)
    # (core-attention needs unfused attention, cp fused: they never meet)
    node_comm = {n: [(fwd, bwd + fwd) for fwd, bwd in row]
                 for n, row in costs.node_comm_s.items()} if policy in ("selective", "full") \
        else costs.node_comm_s
    acts = costs.act_bytes
    if policy == "core-attention":  # the rows less what only the cores saved, plus what
        acts = {k: list(v) for k, v in acts.items()}  # their checkpoints alone hold
        for entries, sign in ((problem.core_saved, -1.0), (problem.core_inputs, 1.0)):
            for owner, nbytes, mult, _part in entries:
                if owner is None or owner not in problem.cands:
                    continue
                row = acts.setdefault(owner, [0.0] * len(problem.cands[owner]))
                for i, c in enumerate(problem.cands[owner]):
                    delta = nbytes * costs.scale * mult / out_divisor(c, problem.tp)
                    row[i] = max(0.0, row[i] + sign * delta)
    if policy == "selective":
        acts = {k: (v if k is None or problem.part.get(k) != "layer" else [0.0] * len(v))
                for k, v in acts.items()}
        kept = list(problem.kept_selective)
        out = boundary_node(problem)
        if out is not None:  # the block inputs, T of them: I_q (module docstring)
            kept.append((out, boundary_bytes(problem), problem.graph.total_layers, "layer"))
        for owner, nbytes, mult, part in kept:
            row = acts.setdefault(owner, [0.0] * len(problem.cands[owner]))
            for i, c in enumerate(problem.cands[owner]):
                row[i] += nbytes * costs.scale * mult / out_divisor(c, problem.tp)
    return dataclasses.replace(costs, compute_s=compute, pairs=pairs, act_bytes=acts,
                               node_comm_s=node_comm)


def block_bytes(problem: Problem, costs: Costs, policy: str = "selective",
                choice: dict[str, int] | None = None) -> float:
    """What one block's recomputation rematerialises at the microbatch, bytes -- the
    transient of its backward:
    - "selective": A_1, one block's saved tensors, replicated (an upper bound under tensor
      parallelism);
    - "core-attention": what one block's attention cores saved, at the candidates of `choice`
      (a solved placement), or split tp ways without one (attention split by heads; the ILP's
      constant).
    0.0 for the other policies and without blocks."""
    if not problem.num_layers or policy not in ("selective", "core-attention"):
        return 0.0
    if policy == "selective":
        return sum(nbytes * costs.scale * mult for _o, nbytes, mult, part in problem.saved
                   if part == "layer") / problem.num_layers
    total = 0.0
    for owner, nbytes, mult, part in problem.core_saved:
        if part != "layer":
            continue
        cands = problem.cands.get(owner) if owner is not None else None
        if choice is None or cands is None or owner not in choice:
            div = float(problem.tp)
        else:
            div = out_divisor(cands[choice[owner]], problem.tp)
        total += nbytes * costs.scale * mult / div
    return total / problem.num_layers


def checkpointed_ranks(ranks: list[RankMemory], policy: str, total_layers: int,
                       input_bytes: float, one_block_bytes: float) -> list[RankMemory]:
    """Per-rank memory forms (pipeline.rank_memories) under `policy`. A rank's block
    activation coefficient is f_r L_r / T, so f_r L_r = coefficient x T."""
    if policy == "none" or not total_layers:
        return ranks
    out = []
    for rank in ranks:
        held = rank.act_coef.get("layer", 0.0) * total_layers  # f_r L_r
        act = dict(rank.act_coef)
        const = rank.const_bytes
        # at the last rank's loss no block recomputes yet: no transient (RankMemory.at_loss)
        transient = bool(held) and not rank.at_loss
        if policy == "full":
            act["layer"] = 1.0 / total_layers if transient else 0.0
            const += held * input_bytes
        else:  # selective, core-attention: the rows are what the blocks keep already
            const += one_block_bytes if transient else 0.0
        out.append(dataclasses.replace(rank, param_coef=dict(rank.param_coef), act_coef=act,
                                       const_bytes=const))
    return out


def checkpointed_solution(sol: Solution, policy: str, total_layers: int, input_bytes: float,
                          one_block_bytes: float) -> tuple[Solution, float]:
    """(the Solution pipeline.assess should see, the transient to add to the peak): under
    "full" the blocks' activation total becomes T x I and one block's activations are the
    transient; under "selective" the rows hold the kept outputs and the blocks' inputs
    already (`checkpointed_costs`) and the transient is A_1 (`block_bytes`)."""
    if policy == "none" or not total_layers:
        return sol, 0.0
    if policy in ("selective", "core-attention"):  # the rows are what the blocks keep
        return sol, one_block_bytes
    layer = sol.act_bytes.get("layer", 0.0)
    acts = {**sol.act_bytes, "layer": total_layers * input_bytes}
    return dataclasses.replace(sol, act_bytes=acts), layer / total_layers
