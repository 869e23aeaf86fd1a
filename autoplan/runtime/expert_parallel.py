"""Expert parallelism at run time ([Note: expert parallelism] in
autoplan/cost_model/expert_parallel.py).

With a plan's `mesh.ep` > 1, groups of ep consecutive dp ranks (same pp and tp coordinates)
hold disjoint slices of every MoE layer's experts: the expert weights of a stage become DTensors
Shard(0) on a 1-D "ep" DeviceMesh (rank r of the group holds experts [r E/ep, (r+1) E/ep)), and
each `autoplan.experts` node runs `experts_all_to_all`:

1. dispatch: every (token, choice) pair of this rank's tokens goes to the rank that holds its
   expert -- sorted by that rank, counts exchanged, one `all_to_all_single` for the hidden
   states, one for the expert ids, one for the routing weights (data-dependent split sizes are
   fine here: eager code, outside the captured graph);
2. the received pairs run the experts op (one choice per row, this rank's expert offset);
3. combine: the weighted outputs go back by the reverse all-to-all and are summed per token.

Autograd runs the same exchanges in reverse (`_AllToAll`), so the gradients of the hidden
states and routing weights come home and every expert weight's gradient holds the
contributions of all tokens its ep group routed to it. Expert weights are left out of FSDP2
(`ignored_params`): their gradients are summed over the ranks holding the same slice (the
"dp_outer" groups, dp / ep ranks each) and divided by dp, which together with the engine's loss
scaling (each rank's loss is its tokens' share of the global mean, x dp) is the gradient of the
global mean loss, as on one process. The router's weights are ordinary replicated weights.

Gradient clipping needs nothing more: an expert gradient is a Shard(0) DTensor on the ep mesh,
whose norm DTensor reduces over the slices (runtime/parallel.py clip_grad_norm).

[Note: dry run routing] A dry run (runtime/dryrun.py) has fake tensors: no router values to
count pairs by (`bincount`'s output shape is data-dependent). Each rank then sends an equal
share of its T k pairs to every rank of its group (torch.chunk's sizes) and receives as many:
the balanced routing the cost model prices ([Note: expert parallelism]); a real run's
imbalance is not in it.

Under ZeRO 2 and 3 the other weights are sharded over dp by FSDP2 as usual and the expert
slices stay whole (replicated over their dp / ep ranks). Under a 16-bit plan they stay fp32
masters, which FSDP2's mixed-precision policy does not cast: the experts op computes in the
hidden states' dtype, casting one expert's weights at a time (autoplan/experts.py), so the
slices' gradients come back in fp32 and are summed in fp32, as the recipe's reduction is.
Under ZeRO-1 the optimizer states of a slice are partitioned over the dp / ep ranks that hold
it (`outer_mesh`; runtime/zero1.py's `groups`), not over dp: its rows are stepped there and
all-gathered there. Supported: ep > 1 with every ZeRO stage, with tp 1 or with tp splitting
the experts (below), cp 1 (`check_expert_parallel`). Checkpoints of an ep plan are not tested.

[Note: experts over ep and tp] At tp > 1 the plan splits whole experts on tp (Shard(0),
passes/experts_local.py: tp rank t holds experts [t E / tp, (t + 1) E / tp), the tokens
replicated, the output a Partial sum over tp). ep splits each rank's share again: the expert
weights become DTensors (Shard(0), Shard(0)) on the 2-D ("ep", "tp") mesh, so rank (e, t)
holds the block e tp + t of E / (ep tp) experts (DTensor's order: ep's split first, tp's
within it). A choice of expert g falls in block c = g // (E / (ep tp)): the tp rank c % tp
computes it, on the ep rank c // tp. So each tp rank exchanges, within its ep group (the ranks
with its tp coordinate), only the choices of its blocks -- 1 / tp of its tokens' choices --
and its output is still its Partial share over tp, which the plan's all-reduce on tp sums
(`_experts_ep_tp`); the gradients of the replicated hidden and routing weights are Partial
over tp, as under tp alone. The blocks of every tp rank partition the experts, so the sum over
tp of the ranks' outputs is the whole op. The planner prices ep at tp > 1 only on placements
whose experts are Shard(0) on tp (solver/search.py); a given ep keeps tp 1 unless tp is given,
and a given tp > 1 pins the experts Shard(0) (solver/planner.py `experts_split`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autoplan import _torch_compat as tc
from autoplan.experts import EXPERTS_OP
from autoplan.passes.experts_local import experts_local
from autoplan.runtime.shutdown import forget_at_exit

__all__ = ["ExpertParallel", "experts_all_to_all", "check_expert_parallel"]


def check_expert_parallel(plan) -> None:
    """ValueError for an ep plan this runtime does not run (module docstring, Supported): at
    tp > 1 the plan must split the experts on tp (Shard(0)), which the build checks per weight
    (`ExpertParallel.shard`)."""
    mesh = plan.mesh
    if mesh.ep > 1 and mesh.cp > 1:
        raise ValueError(f"expert parallelism (ep {mesh.ep} in {mesh}) runs with cp 1")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def experts_all_to_all(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act: str,
                       expert_offset: int):
    """`autoplan.experts` with the experts split over an ep group (module docstring).

    hidden (T, H), top_k_index and top_k_weights (T, k): this rank's tokens (plain tensors).
    gate_up_proj (E, 2I, H), down_proj (E, H, I): DTensors Shard(0) on a 1-D mesh (the ep
    group); plain tensors fall back to `experts_local`. Returns (T, H)."""
    if not isinstance(gate_up_proj, DTensor):
        return experts_local(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                             expert_offset)
    if gate_up_proj.device_mesh.ndim == 2:
        return _experts_ep_tp(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                              expert_offset)
    mesh = gate_up_proj.device_mesh
    local_gate_up = gate_up_proj.to_local()
    num_local = local_gate_up.shape[0]
    flat = top_k_index.reshape(-1) - expert_offset                   # (T k,) global expert ids
    dest = torch.div(flat, num_local, rounding_mode="floor")        # (T k,) owning ep rank
    return _exchange(hidden, top_k_weights, flat, top_k_index.shape[1], None, dest, mesh,
                     (local_gate_up, down_proj.to_local()), act,
                     mesh.get_local_rank() * num_local)


def _exchange(x, w, flat, top_k: int, pairs, dest, ep_mesh, weights, act: str, offset: int):
    """Dispatch the (token, choice) pairs `pairs` (flat indices into the T k pairs; None: all
    of them) of this rank's tokens x (T, H) to the ep ranks `dest` (one per pair) holding their
    experts, run the experts op there on the rank's own experts `weights` (local gate_up_proj,
    down_proj; global ids from `offset`), and combine the weighted outputs back per token:
    (T, H). Counts exchanged first; in a dry run (fake tensors, no values to route by) an
    equal share to every rank ([Note: dry run routing])."""
    group, size = ep_mesh.get_group(), ep_mesh.size()
    order = torch.argsort(dest, stable=True)                        # pairs grouped by owner
    if pairs is not None:
        order = pairs[order]
    token_of = torch.div(order, top_k, rounding_mode="floor")       # the token of each pair
    if tc.is_fake(dest):
        sends = [len(r) for r in torch.empty(len(order), device="meta").chunk(size)]
        sends += [0] * (size - len(sends))
        recvs = list(sends)
    else:
        in_splits = torch.bincount(dest, minlength=size)            # pairs sent to each rank
        out_splits = torch.empty_like(in_splits)
        dist.all_to_all_single(out_splits, in_splits, group=group)  # pairs received from each
        sends, recvs = in_splits.tolist(), out_splits.tolist()
    xs = _AllToAll.apply(x[token_of], recvs, sends, group)                      # (R, H)
    ws = _AllToAll.apply(w.reshape(-1)[order, None], recvs, sends, group)      # (R, 1)
    ids = flat[order, None].contiguous()
    ids_recv = ids.new_empty((sum(recvs), 1))
    dist.all_to_all_single(ids_recv, ids, recvs, sends, group=group)          # (R, 1)
    y = EXPERTS_OP(xs, ids_recv, ws, *weights, act, offset)                    # (R, H)
    back = _AllToAll.apply(y, sends, recvs, group)                             # (pairs, H)
    return x.new_zeros(x.shape).index_add(0, token_of, back.to(x.dtype))


def _experts_ep_tp(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act: str,
                   expert_offset: int):
    """`autoplan.experts` with the experts split over tp and ep together (module docstring,
    [Note: experts over ep and tp]): gate_up_proj and down_proj DTensors (Shard(0), Shard(0))
    on the 2-D ("ep", "tp") mesh; hidden (T, H), top_k_index and top_k_weights (T, k)
    Replicate on the tp mesh (or plain). Returns (T, H) Partial on the tp mesh: this tp rank's
    share, the sum over the experts its ep group holds."""
    mesh = gate_up_proj.device_mesh
    ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
    tokens = (hidden, top_k_index, top_k_weights)
    if any(isinstance(t, DTensor) and t.placements != (Replicate(),) for t in tokens) or \
            gate_up_proj.placements != (Shard(0), Shard(0)) or \
            down_proj.placements != gate_up_proj.placements:
        raise ValueError(
            "experts over ep and tp: expected hidden, top_k_index, top_k_weights Replicate on "
            "tp and the two expert weights (Shard(0), Shard(0)) on (ep, tp); got "
            f"{[getattr(t, 'placements', 'plain') for t in tokens]}, "
            f"{gate_up_proj.placements}, {down_proj.placements}")
    x, w = (t.to_local(grad_placements=(Partial(),)) if isinstance(t, DTensor) else t
            for t in (hidden, top_k_weights))
    idx = top_k_index.to_local() if isinstance(top_k_index, DTensor) else top_k_index
    local_gate_up = gate_up_proj.to_local()
    tp, t = tp_mesh.size(), tp_mesh.get_local_rank()
    num_local = local_gate_up.shape[0]
    num_tokens, top_k = idx.shape
    flat = idx.reshape(-1) - expert_offset                           # (T k,) global expert ids
    chunk = torch.div(flat, num_local, rounding_mode="floor")       # block e' tp + t' holding it
    if tc.is_fake(chunk):  # a dry run: this tp rank's mean share ([Note: dry run routing])
        pairs = torch.arange(num_tokens * top_k // tp, device=flat.device)
        dest = torch.zeros_like(pairs)
    else:
        pairs = torch.nonzero(chunk % tp == t).squeeze(1)          # the pairs of this tp rank
        dest = torch.div(chunk[pairs], tp, rounding_mode="floor")   # their owning ep rank
    out = _exchange(x, w, flat, top_k, pairs, dest, ep_mesh,
                    (local_gate_up, down_proj.to_local()), act,
                    (ep_mesh.get_local_rank() * tp + t) * num_local)
    return DTensor.from_local(out, tp_mesh, (Partial(),), run_check=False,
                              shape=torch.Size(hidden.shape), stride=out.stride())


class ExpertParallel:
    """This rank's expert-parallel state: the ep mesh, the groups that share an expert slice,
    and the expert weights (module docstring). Collective to construct (process groups).

    Args:
        mesh: the engine's ("pp", "dp", "tp") DeviceMesh.
        ep: the plan's expert-parallel degree (divides the dp size).
        tp_placement: FQN -> the plan's tp placement of that parameter ("S(0)", "R", ...;
            `Plan.placement_of`), read at tp > 1.
    """

    def __init__(self, mesh: DeviceMesh, ep: int, tp_placement=None):
        self.tp_placement = tp_placement or (lambda fqn: "R")
        pp, dp, tp = mesh.mesh.shape
        self.ep, self.dp = ep, dp
        # the engine's mesh, its dp axis split in two: row-major over the world as it is
        mesh4 = tc.shared_mesh(mesh.device_type, (pp, dp // ep, ep, tp),
                               ("pp", "dp_outer", "ep", "tp"))
        assert mesh4.mesh.equal(mesh.mesh.reshape(pp, dp // ep, ep, tp)), "mesh not row-major"
        forget_at_exit(mesh4)  # a root mesh of its own ([Note: orderly exit])
        self.ep_mesh = mesh4["ep"]
        # tp's expert split, split again over ep ([Note: experts over ep and tp])
        self.ep_tp_mesh = mesh4["ep", "tp"] if tp > 1 else None
        # the dp / ep ranks that hold the same slice (None: this rank alone)
        self.outer_mesh = mesh4["dp_outer"] if dp // ep > 1 else None
        self.outer_group = self.outer_mesh.get_group() if self.outer_mesh is not None else None
        self.params: list[nn.Parameter] = []

    def shard(self, gm: torch.fx.GraphModule,
              routed: list[tuple[torch.fx.Node, torch.fx.Node]]) -> list[nn.Parameter]:
        """Make the expert weights of stage `gm` Shard(0) DTensors on the ep mesh (on the meta
        device; the engine allocates): `routed` is passes/experts_local.py `route_experts`'
        (experts node, weight node) pairs, its experts nodes already pointed at
        `experts_all_to_all` (the lowering's step 7, [Note: pass order] in
        autoplan/passes/lowering.py). Returns those parameters in graph order -- the same on
        every rank, which `reduce_gradients` relies on (its all-reduces pair tensors by order)
        -- for FSDP2's `ignored_params`.

        Raises ValueError when an expert count does not divide by ep."""
        found: list[nn.Parameter] = []
        for _, arg in routed:
            p = self._distribute(gm, arg)
            if all(p is not q for q in found):
                found.append(p)
        self.params += [p for p in found if all(p is not q for q in self.params)]
        return found

    def _distribute(self, gm, arg) -> nn.Parameter:
        owner_path, _, leaf = arg.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        p = owner._parameters[leaf]
        if isinstance(p, DTensor):
            return p  # a weight two experts nodes read: distributed at the first
        if self.ep_tp_mesh is not None:  # tp's split of the experts, split again over ep
            tp = self.ep_tp_mesh.size(1)
            if self.tp_placement(str(arg.target)) != "S(0)":
                raise ValueError(
                    f"{arg.target}: under ep {self.ep} with tp {tp} the plan must split the "
                    f"experts on tp (Shard(0)); it places them "
                    f"{self.tp_placement(str(arg.target))}")
            if p.shape[0] % (self.ep * tp):
                raise ValueError(f"{arg.target}: {p.shape[0]} experts do not divide by ep "
                                 f"{self.ep} x tp {tp}")
            owner._parameters[leaf] = nn.Parameter(
                distribute_tensor(p.data, self.ep_tp_mesh, [Shard(0), Shard(0)]),
                requires_grad=p.requires_grad)
            return owner._parameters[leaf]
        if p.shape[0] % self.ep:
            raise ValueError(f"{arg.target}: {p.shape[0]} experts do not divide by ep {self.ep}")
        owner._parameters[leaf] = nn.Parameter(distribute_tensor(p.data, self.ep_mesh,
                                                                 [Shard(0)]))
        return owner._parameters[leaf]

    def reduce_gradients(self) -> None:
        """Sum the expert weights' gradients over the ranks holding the same slice and divide
        by dp (module docstring): after the last microbatch's backward, before the optimizer."""
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.outer_group is not None:
                dist.all_reduce(g, group=self.outer_group)
            g.div_(self.dp)
