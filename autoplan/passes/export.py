"""Export the rewritten per-rank graphs: readable Python, Graphviz and JSON.

Each rank's stage graph (after `split_stages` and `apply_placements`) is interpreted under DTensor
on a *fake* process group and traced with `make_fx` on fake tensors into a local graph: local
shard shapes, and every collective the plan inserted as an explicit `_c10d_functional` call
(docs/design.md, "Passes": this is the exported artifact). Nothing is allocated, so a 70B
model exports on a laptop.

Ranks that differ only in their dp coordinate run the same code; one file is written per
(pp rank, cp rank, tp rank) with the dp ranks that share it listed in the header, together with
the collectives outside the forward graph: pipeline send/recv and the dp (x cp) gradient
synchronisation of the plan's ZeRO stage. Under context parallelism the graph is the one
captured at seq / cp tokens per sample and rewritten as the runtime rewrites it
(autoplan/passes/context_parallel.py): each attention's K/V all-gather over the cp group is in the
graph, and the rank's global positions are its `_cp_positions` input.

The op names are aten's (`_unsafe_view_3`), so the files say what the names do not: above
each run of ops a comment names the module they run for (`# model.layers.0.self_attn.o_proj`,
the captured node's module path, so a block's ops carry the rank's own block index), and each
call that names a process group ('8') ends with that group's mesh axis and global ranks, which
the header also lists; the JSON rows carry both (`module`, `group`). The placed stage graphs
are made once per export and copied for each traced rank (passes/lowering.py `place_stages`;
each rank's share is `lower_rank`, [Note: pass order]).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from autoplan._torch_compat import (clear_dtensor_caches, implicit_replication,
                                    quiet_understood_warnings)
from autoplan.graph import CapturedGraph
from autoplan.passes.lowering import (LoweringOptions, PlacedStages, RankCoords, lower_rank,
                                     place_stages)
from autoplan.passes.sharding import value_placements
from autoplan.plan import Plan, parse_placement

__all__ = ["export_plan", "shared_stages", "trace_rank", "COLLECTIVE_OPS", "count_collectives",
           "count_kernels"]

COLLECTIVE_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                  "all_to_all_single", "broadcast")


def count_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Functional collectives in a traced local graph, by name."""
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and "_c10d_functional" in str(node.target):
            name = str(node.target).split(".")[-2]
            if name in COLLECTIVE_OPS:
                out[name] = out.get(name, 0) + 1
    return out


def count_kernels(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Calls of the fused kernels' ops (`torch.ops.autoplan.*`, [Note: kernel fusion]) in a
    traced local graph, by op name."""
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "autoplan":
            name = node.target._opname
            out[name] = out.get(name, 0) + 1
    return out


def _local_shape(shape, placement: str, tp: int) -> tuple[int, ...]:
    p = parse_placement(placement)
    shape = list(shape)
    if p.is_shard():
        shape[p.dim] //= tp
    return tuple(shape)


def _val(node: torch.fx.Node):
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def shared_stages(graph: CapturedGraph, plan: Plan, kernels: bool = True,
                  planned: CapturedGraph | None = None) -> PlacedStages:
    """What every rank's trace of `plan` shares (passes/lowering.py `place_stages`: the stage
    graphs with the plan's placements applied and, under cp 1, the fused kernels). `planned`:
    under cp > 1, the graph captured at the whole sequence. Raises ValueError where
    `place_stages` does."""
    nodes = None
    if plan.mesh.cp > 1 and planned is not None:
        from autoplan.passes.expand import counterparts

        nodes = counterparts(planned, graph)
    return place_stages(graph, plan, LoweringOptions(kernels=kernels), planned=nodes)


def trace_rank(graph: CapturedGraph, plan: Plan, pp_rank: int, tp_rank: int,
               kernels: bool = True, cp_rank: int = 0,
               planned: CapturedGraph | None = None, shared: PlacedStages | None = None):
    """Trace the local forward graph(s) of mesh coordinate (pp_rank, dp 0, cp_rank, tp_rank),
    with the fused kernels' ops in place of their patterns as the runtime runs them
    (`kernels`, see autoplan/passes/kernels.py). Under cp > 1 `graph` is the model captured at
    plan.seq_len / cp tokens per sample, rewritten for cp rank `cp_rank` as the runtime does
    (passes/context_parallel.py; `planned`: the graph captured at the whole sequence, to tell
    position indexes apart). `shared`: `shared_stages(graph, plan, kernels, planned)`, made
    once for the ranks of an export (made here when None). The rank's graphs are the
    lowering's (passes/lowering.py `lower_rank` without a runtime: [Note: pass order] up to
    the kernels).

    Each traced op's `meta["module_path"]` is the path of the module it runs for (absent for
    the views DTensor.from_local / to_local add at the stage's edges), and the traced module's
    `meta["process_groups"]` is {group name: (mesh axis, global ranks)} of this rank's group
    on each mesh axis: what the exported files write beside the ops and collectives.

    Needs an initialised default process group of plan.mesh.world_size ranks (a fake one is
    fine). Returns [(stage_index, traced GraphModule, stage input names, output names)].
    Raises ValueError where the cp rewrite does (passes/context_parallel.py).
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=plan.mesh.axis_names)
    tp_mesh = mesh["tp"]
    groups = _mesh_groups(mesh)
    tp, cp = plan.mesh.tp, plan.mesh.cp
    if shared is None:
        shared = shared_stages(graph, plan, kernels, planned)
    assert shared.options.kernels == kernels, "shared stages made with another `kernels`"
    cp_group = mesh["cp"].get_group().group_name if cp > 1 else ""
    lowered = lower_rank(graph, plan, RankCoords(pp_rank, cp_rank, tp_rank, cp_group),
                         shared.options, placed=shared)
    produced = value_placements(plan)
    out = []
    for sg in lowered.stage_graphs:
        attrs = [n.target for n in sg.gm.graph.nodes if n.op == "get_attr"]
        placeholders = [n for n in sg.gm.graph.nodes if n.op == "placeholder"]
        in_pl = [produced.get(n, "R") for n in sg.input_names]

        def run(*flat, _sg=sg, _attrs=attrs, _in_pl=in_pl):
            params, inputs = flat[:len(_attrs)], flat[len(_attrs):]
            for target, local in zip(_attrs, params):
                owner_path, _, leaf = target.rpartition(".")
                owner = _sg.gm.get_submodule(owner_path) if owner_path else _sg.gm
                value = local
                if tp > 1:
                    value = DTensor.from_local(
                        local, tp_mesh, (parse_placement(plan.placement_of(target)),),
                        run_check=False)
                owner._parameters.pop(leaf, None)
                owner._buffers.pop(leaf, None)
                setattr(owner, leaf, value)
            if tp > 1:
                inputs = [DTensor.from_local(x, tp_mesh, (parse_placement(p),), run_check=False)
                          for x, p in zip(inputs, _in_pl)]
            # an Interpreter under preserve_node_meta: each traced op records the stage node
            # it came from (meta["from_node"]), which names its module
            with implicit_replication(), fx_traceback.preserve_node_meta():
                result = torch.fx.Interpreter(_sg.gm).run(*inputs)
            flat_out = result if isinstance(result, tuple) else (result,)
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in flat_out)

        with FakeTensorMode(allow_non_fake_inputs=True):
            args = []
            for target in attrs:  # the stage's own: the cp pass adds `_cp_positions`
                t = sg.gm.get_parameter(target) if _is_param(sg.gm, target) \
                    else sg.gm.get_buffer(target)
                args.append(torch.empty(_local_shape(t.shape, plan.placement_of(target), tp),
                                        dtype=t.dtype))
            for node, p in zip(placeholders, in_pl):
                v = _val(node)
                args.append(torch.empty(_local_shape(v.shape, p, tp), dtype=v.dtype))
            traced = make_fx(run)(*args)
        _name_placeholders(traced, attrs + [n.name for n in placeholders])
        paths = _module_paths(sg.gm, graph)
        for node in traced.graph.nodes:
            source = node.meta.get("from_node")
            if source and source[0].name in paths:
                node.meta["module_path"] = paths[source[0].name]
        traced.meta["process_groups"] = groups
        out.append((sg.index, traced, sg.input_names, sg.output_names))
    return out


def _mesh_groups(mesh) -> dict[str, tuple[str, list[int]]]:
    """{group name: (mesh axis, global ranks)} of this rank's group on each mesh axis."""
    out = {}
    for axis in mesh.mesh_dim_names:
        group = mesh[axis].get_group()
        out[group.group_name] = (axis, dist.get_process_group_ranks(group))
    return out


def _module_paths(gm: torch.fx.GraphModule, graph: CapturedGraph) -> dict[str, str]:
    """The module path of each call_function node of a stage graph: its captured node's
    (`NodeInfo.module_path`, found by `meta["orig_name"]`; a fused kernel's is its pattern's
    output's); an inserted redistribution's, the longest module path that holds every consumer
    (one gather shared by gate and up projections: `model.layers.0.mlp`)."""
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        info = graph.nodes.get(node.meta.get("orig_name", node.name))
        if node.op == "call_function" and info is not None:
            out[node.name] = info.module_path
    for node in reversed(gm.graph.nodes):  # consumers first: a redistribution may feed one
        if "redistribute_for" in node.meta:
            users = [out[u.name].split(".") for u in node.users if u.name in out]
            out[node.name] = ".".join(os.path.commonprefix(users))
    return out


def _graph_seq_len(graph: CapturedGraph) -> int | None:
    """The sequence length of the token input the graph was captured with ((b, s) integer
    ids), None for another input form."""
    for n in graph.gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point():
            return int(v.shape[1])
    return None


def _is_param(gm: torch.nn.Module, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _name_placeholders(gm: torch.fx.GraphModule, names: list[str]) -> None:
    """Give the traced placeholders the FQNs / value names they stand for."""
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node.name = node.target = name.replace(".", "_")
    gm.recompile()


def _rank(plan: Plan, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
    """The global rank of a mesh coordinate (axes pp, dp, cp, tp, row-major)."""
    return ((pp_rank * plan.mesh.dp + dp_rank) * plan.mesh.cp + cp_rank) * plan.mesh.tp \
        + tp_rank


def _header(plan: Plan, pp_rank: int, tp_rank: int, stage: int, inputs, outputs,
            collectives: dict[str, int], fused: dict[str, int], cp_rank: int = 0,
            process_groups: dict[str, tuple[str, list[int]]] | None = None) -> str:
    cp = plan.mesh.cp
    ranks = [_rank(plan, pp_rank, d, tp_rank, cp_rank) for d in range(plan.mesh.dp)]
    num_stages = len(plan.stages)
    st = plan.stages[stage]
    where = f"pp rank {pp_rank}, " + (f"cp rank {cp_rank}, " if cp > 1 else "") + \
        f"tp rank {tp_rank}, every dp rank"
    groups = "tp group" + (", cp group" if cp > 1 else "")
    if process_groups:
        named = [f"# process groups this graph names (global rank {ranks[0]}'s; each dp rank "
                 "has its own on the same mesh axes):"]
        named += [f"#   '{name}': {axis} axis, global ranks {members}"
                  for name, (axis, members) in process_groups.items()]
    else:
        named = ["# process groups this graph names: none"]
    lines = [
        f"# autoplan export: {plan.model} on {plan.topology}, mesh {plan.mesh} "
        f"(axes {', '.join(plan.mesh.axis_names)}), ZeRO-{plan.zero_stage}, "
        f"schedule {plan.schedule}",
        f"# pipeline stage {stage} of {num_stages}: layers [{st.layer_start}, {st.layer_end})",
        f"# runs on global ranks {ranks} ({where})",
        f"# forward collectives in this graph ({groups}): {collectives or 'none'}",
        *named,
        f"# fused kernel calls (torch.ops.autoplan, autoplan/passes/kernels.py): "
        f"{fused or 'none'}",
        f"# stage inputs: {inputs}",
        f"# stage outputs: {outputs}",
    ]
    if cp > 1:
        group = [_rank(plan, pp_rank, 0, tp_rank, c) for c in range(cp)]
        lines.append(
            f"# context parallelism: cp group {group} (dp 0); "
            f"{plan.seq_len // cp} of {plan.seq_len} tokens per sample, chunks "
            f"{cp_rank} and {2 * cp - 1 - cp_rank} of {2 * cp} (input _cp_positions); K and V "
            "all-gathered over the cp group in each attention")
    if stage > 0:
        lines.append(f"# recv activations from stage {stage - 1} (rank "
                     f"{_rank(plan, (stage - 1) % plan.mesh.pp, 0, tp_rank, cp_rank)} for dp 0)")
    if stage < num_stages - 1:
        lines.append(f"# send activations to stage {stage + 1} (rank "
                     f"{_rank(plan, (stage + 1) % plan.mesh.pp, 0, tp_rank, cp_rank)} for dp 0)")
    if plan.mesh.dp_shard > 1:
        sync = {0: "all-reduce of gradients (replicate)",
                1: "all-reduce of gradients + broadcast of updated parameters (ZeRO-1)",
                2: "reduce-scatter of gradients; parameters all-gathered once per step",
                3: "all-gather of parameters before forward and backward, reduce-scatter of "
                   "gradients"}[plan.zero_stage]
        if cp > 1:
            shard = [_rank(plan, pp_rank, d, tp_rank, c) for d in range(plan.mesh.dp)
                     for c in range(cp)]
            lines.append(f"# dp x cp group {shard}: {sync}")
        else:
            lines.append(f"# dp group {ranks}: {sync}")
    return "\n".join(lines) + "\n"


def _group_name(node: torch.fx.Node) -> str | None:
    """The process group a call names (its op's `group_name` argument: every functional
    collective, the cp attention), else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    names = [a.name for a in node.target._schema.arguments]
    if "group_name" not in names:
        return None
    i = names.index("group_name")
    return str(node.kwargs["group_name"] if i >= len(node.args) else node.args[i])


def _group(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[str, list[int]] | None:
    """(mesh axis, global ranks) of the process group `node` names, else None."""
    name = _group_name(node)
    if name is None:
        return None
    groups = gm.meta["process_groups"]
    assert name in groups, f"{node.name} names process group {name!r}, no mesh axis's: {groups}"
    return groups[name]


def _module(node: torch.fx.Node) -> str:
    """The module path a traced op is written under (`trace_rank`)."""
    path = node.meta.get("module_path")
    if path is None:  # DTensor.from_local / to_local in `trace_rank`'s `run`
        return "(local shards of the stage's inputs and outputs)"
    return path or "(top-level module)"


def _python(gm: torch.fx.GraphModule) -> str:
    """`gm.code` with what names alone do not say: above each run of ops of one module, a
    comment line with its path (`# model.layers.0.self_attn.o_proj`); after each call that
    names a process group, the group's mesh axis and global ranks."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    lines, current = [], None
    for line in gm.code.splitlines(keepends=True):
        node = by_name.get(line.strip().split(" = ", 1)[0])
        if node is not None and _module(node) != current:
            current = _module(node)
            lines.append(f"    # {current}\n")
        group = None if node is None else _group(gm, node)
        if group is not None:
            line = f"{line.rstrip()}  # {group[0]} axis, ranks {group[1]}\n"
        lines.append(line)
    return "".join(lines)


def _dot(gm: torch.fx.GraphModule, title: str) -> str:
    lines = [f'digraph "{title}" {{', "  rankdir=TB; node [shape=box, fontsize=10];"]
    for node in gm.graph.nodes:
        label = node.name if node.op != "call_function" else f"{node.name}\\n{node.target}"
        style = ', style=filled, fillcolor="#ffd27f"' if "_c10d_functional" in str(
            node.target) else ""
        group = _group(gm, node)
        if group is not None:
            label += f"\\n{group[0]} axis, ranks {group[1]}"
        if node.op == "call_function":
            style += f', tooltip="{_module(node)}"'
        lines.append(f'  "{node.name}" [label="{label}"{style}];')
        for a in node.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _json(gm: torch.fx.GraphModule) -> list[dict]:
    rows = []
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        group = _group(gm, node)
        rows.append({
            "name": node.name, "op": node.op, "target": str(node.target),
            "inputs": [a.name for a in node.all_input_nodes],
            "shape": list(v.shape) if isinstance(v, torch.Tensor) else None,
            "collective": "_c10d_functional" in str(node.target),
            "module": node.meta.get("module_path"),
            "group": None if group is None else {"name": _group_name(node), "axis": group[0],
                                                 "ranks": group[1]},
        })
    return rows


def export_plan(graph: CapturedGraph, plan: Plan, out_dir: str | os.PathLike,
                kernels: bool = True, planned: CapturedGraph | None = None) -> dict[str, Path]:
    """Write per-rank graphs for `plan` into `out_dir` (created; files replaced atomically, the
    graphs of an earlier export there that this plan does not have removed):
    `plan.json`, and per (pp rank, cp rank, tp rank) and stage `rank{r}_stage{s}.py` (local
    graph code), `.dot` (Graphviz) and `.json`. Returns {name: path}. With `kernels` the graphs
    call the fused kernels where the runtime does (`torch.ops.autoplan.rms_norm`, ...; the
    header counts them). Under cp > 1 `graph` is the model captured at plan.seq_len / cp
    tokens per sample and `planned` the one captured at the whole sequence (`trace_rank`).

    Runs on a fake process group in this process; when a process group already exists here
    (inside torchrun), raises RuntimeError -- export from a planning process instead.
    Raises ValueError when the graph was captured with fewer layers than the model has, or
    (cp > 1) at another sequence length than plan.seq_len / cp.
    """
    if graph.num_layers != graph.total_layers:
        raise ValueError(
            f"export needs the full model: the graph was captured with {graph.num_layers} of "
            f"{graph.total_layers} layers")
    cp = plan.mesh.cp
    seq = _graph_seq_len(graph)
    if cp > 1 and seq is not None and seq != plan.seq_len // cp:
        raise ValueError(
            f"export of {plan.mesh}: the graph was captured at {seq} tokens per sample; a cp "
            f"{cp} rank runs {plan.seq_len // cp} of the plan's {plan.seq_len} (capture at "
            "seq_len / cp)")
    quiet_understood_warnings()
    if dist.is_initialized():
        raise RuntimeError("export_plan runs on a fake process group and needs a process "
                           "without an initialised default group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out_dir = Path(out_dir)
    files: dict[str, str] = {"plan.json": plan.to_json()}
    shared = shared_stages(graph, plan, kernels, planned)
    # traced in memory first: a failure writes nothing (all-or-nothing outputs)
    for pp_rank, cp_rank, tp_rank in itertools.product(range(plan.mesh.pp), range(cp),
                                                       range(plan.mesh.tp)):
        rank = _rank(plan, pp_rank, 0, tp_rank, cp_rank)
        dist.init_process_group("fake", store=FakeStore(), rank=rank,
                                world_size=plan.mesh.world_size)
        try:
            traced = trace_rank(graph, plan, pp_rank, tp_rank, kernels, cp_rank, planned,
                                shared)
        finally:
            dist.destroy_process_group()
            clear_dtensor_caches()
        for stage, gm, ins, outs in traced:
            stem = f"rank{rank}_stage{stage}"
            named = {_group_name(n): _group(gm, n) for n in gm.graph.nodes
                     if _group_name(n) is not None}  # in order of first use
            header = _header(plan, pp_rank, tp_rank, stage, ins, outs,
                             count_collectives(gm), count_kernels(gm), cp_rank, named)
            files[f"{stem}.py"] = header + _python(gm)
            files[f"{stem}.dot"] = _dot(gm, stem)
            files[f"{stem}.json"] = json.dumps(_json(gm), indent=1)
    # only now: a failed trace leaves nothing; all or nothing, with a report's permissions
    from autoplan.report.write import write_files

    written = write_files(files, out_dir)
    # a previous export's graphs of ranks or stages this plan does not have would read as
    # this plan's: remove them (only files of the export's own naming)
    for old in out_dir.glob("rank*_stage*.*"):
        if old.name not in files and re.fullmatch(r"rank\d+_stage\d+\.(py|dot|json)", old.name):
            old.unlink()
    return written
