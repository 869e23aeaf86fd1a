"""Weights used by several pipeline stages (a tied embedding and head): each stage holds its
own copy, and their gradients are summed over the stages that hold them before the optimizer
step, so the copies stay identical (step 8 of runtime/engine.py); each stage's own copy is
made by the lowering (passes/stages.py `untie_across_stages`)."""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist

from autoplan._torch_compat import outside_fake_mode
from autoplan.runtime.parallel import local_tensor

__all__ = ["sync_tied_grads", "tied_groups"]


def tied_groups(engine) -> dict:
    """For parameters held by several stages: FQN -> (the local copies, a process group over
    the pp ranks that hold copies (same coordinates on every other mesh axis: dp, cp, tp), or
    None when local). Sets
    `engine.tied_owner_stage` (FQN -> the first stage holding it). Collective: every rank
    creates every group, in the same order."""
    holders: dict[str, set[int]] = defaultdict(set)
    stage_params: dict[str, list] = defaultdict(list)
    pp = engine.plan.mesh.pp
    for idx, fqns in engine._stage_param_fqns.items():
        for fqn in fqns:
            holders[fqn].add(idx)
    for idx, m in engine.stages:
        for name, p in m.named_parameters():
            if len(holders.get(name, ())) > 1:
                stage_params[name].append(p)
    # Each tied weight counts once in a global gradient norm: in its first stage.
    engine.tied_owner_stage = {fqn: min(h) for fqn, h in holders.items() if len(h) > 1}
    groups = {}
    # Every rank creates every group, in the same order (new_group is collective).
    # the global ranks of each pp line: one row per coordinate on the other axes (dp, cp, tp)
    axis = engine.mesh.mesh_dim_names.index("pp")
    with outside_fake_mode():  # the rank table, also in a dry run (runtime/dryrun.py)
        lines = engine.mesh.mesh.movedim(axis, -1).reshape(-1, pp).tolist()
    for fqn in sorted(n for n, h in holders.items() if len(h) > 1):
        pp_ranks = sorted({s % pp for s in holders[fqn]})
        mine = None
        if len(pp_ranks) > 1:
            for line in lines:
                ranks = [line[r] for r in pp_ranks]
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = g
        if fqn in stage_params:
            groups[fqn] = (stage_params[fqn], mine)
    return groups



def sync_tied_grads(engine) -> None:
    """Sum each tied weight's gradient over its copies (local, then over the pp group)."""
    for fqn, (copies, group) in engine._tied.items():
        grads = [p.grad for p in copies if p.grad is not None]
        if not grads:
            continue
        total = local_tensor(grads[0]).clone()
        for g in grads[1:]:
            total += local_tensor(g)
        if group is not None:
            dist.all_reduce(total, group=group)
        for g in grads:
            local_tensor(g).copy_(total)
