"""The plan report as Markdown, and the compact summary the CLI prints.

Sections, in order: summary, mesh axes and topology levels, predicted step, memory per rank,
the dry run of some ranks (when the plan records one: report/measured.py), pipeline stages,
tensor-parallel placements, redistributions, compute and communication per part,
alternatives, formulas. Every number comes from `report.facts` (or the Plan itself).
"""

from __future__ import annotations

from types import SimpleNamespace

from autoplan.cost_model.config import blocks_text
from autoplan.graph import CapturedGraph
from autoplan.plan import MeshShape, Plan
from autoplan.report import facts as F
from autoplan.report import measured as M
from autoplan.report.formulas import plan_formulas
from autoplan.report.timeline import busiest_rank_s, predicted_stage_s, stage_costs
from autoplan.spec import precision_recipe
from autoplan.topology import Topology

__all__ = ["render_markdown", "render_summary", "markdown_sections", "ZERO_TEXT"]

ZERO_TEXT = {
    0: "stage 0: parameters, gradients and optimizer states replicated on the dp axis",
    1: "stage 1: optimizer states sharded on the dp axis",
    2: "stage 2: optimizer states and gradients sharded on the dp axis",
    3: "stage 3: optimizer states, gradients and parameters sharded on the dp axis",
}


def zero_text(plan: Plan) -> str:
    """ZERO_TEXT of the plan's stage; at dp x cp 1 there is no dp axis to replicate or shard
    over, and the text says so."""
    if plan.mesh.dp * plan.mesh.cp == 1:
        return (f"stage {plan.zero_stage}: no data parallelism (dp 1): every rank holds its "
                "parameters, gradients and optimizer states whole")
    return ZERO_TEXT[plan.zero_stage]


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    def cell(x: object) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return lines + [""]


def _cluster_text(topology: Topology | None, plan: Plan) -> str:
    if topology is None:
        return f"{plan.topology} (world size {plan.mesh.world_size}; topology not given)"
    return (f"{topology.name}: {F.plural(topology.num_nodes, 'node')} x "
            f"{topology.devices_per_node} {topology.device.name} = "
            f"{F.plural(topology.world_size, 'device')}"
            + ("" if topology.measured else "; figures not measured on this cluster"))


def _model_text(plan: Plan, graph: CapturedGraph | None) -> str:
    if graph is None:
        return plan.model
    text = f"{plan.model}, {F.fmt_count(F.model_num_params(graph))} parameters"
    if graph.num_layers:
        text += f", {graph.total_layers} blocks"
        if graph.num_layers != graph.total_layers:
            text += f" (planned from {graph.num_layers} captured identical blocks)"
    return text


def _summary(plan: Plan, graph, topology, dtype_origin: str = "") -> list[str]:
    m = plan.mesh
    tokens = plan.global_batch * plan.seq_len
    sched = plan.schedule + (f", {plan.num_virtual_stages} model chunks per pp rank"
                             if plan.num_virtual_stages > 1 else "")
    rows = [
        ["model", _model_text(plan, graph)],
        ["cluster", _cluster_text(topology, plan)],
        ["mesh", f"{F.mesh_text(m)} = world size {m.world_size}" + (
            f"; expert parallelism ep {m.ep} inside dp: groups of {m.ep} dp ranks hold "
            f"disjoint experts and exchange tokens by all-to-all (see experts)"
            if m.ep > 1 else "")],
        *([["context parallelism", _context_text(plan)]] if m.cp > 1 else []),
        *([["experts", ex]] if (ex := F.experts_text(plan, graph)) else []),
        ["ZeRO", zero_text(plan)],
        ["batch", f"global {plan.global_batch} = dp {m.dp} x "
                  f"{F.plural(plan.num_microbatches, 'microbatch')} x "
                  f"{F.plural(plan.microbatch_size, 'sample')}; seq {plan.seq_len}; "
                  f"{F.fmt_count(tokens)} tokens per step"],
        ["schedule", sched if m.pp > 1 else f"{sched} (pp 1: gradient accumulation over "
                                            f"{F.plural(plan.num_microbatches, 'microbatch')})"],
        *([["fine-tuning", tt]] if (tt := F.trainable_text(plan, graph)) else []),
        ["activation checkpointing", plan.checkpointing],
        *([["CPU offload", _offload_text(plan, topology)]] if plan.offload != "none" else []),
        *([["sequence parallelism", sp]] if (sp := _sequence_text(plan, graph)) else []),
        ["dtype", f"{plan.dtype}{f' ({dtype_origin})' if dtype_origin else ''}: "
                  + precision_recipe(plan.dtype, plan.frozen_dtype,
                                     len(plan.float8_linears))],
        *([["execution", "compiled: torch.compile per block, priced without DTensor "
                         "dispatch per op and with pointwise chains fused"]]
          if plan.compiled else []),
    ]
    return [f"# autoplan: {plan.model} on {plan.topology}", "", "## Summary", "",
            *_table(["", ""], rows)]


def _context_text(plan: Plan) -> str:
    """What cp does to this plan ([Note: context parallelism] in
    autoplan/cost_model/context_parallel.py)."""
    cp, p = plan.mesh.cp, plan.prediction
    return (f"cp {cp}: every sample's {plan.seq_len} tokens in {2 * cp} chunks of "
            f"{plan.seq_len // (2 * cp)}, cp rank i holding chunks i and {2 * cp - 1} - i "
            f"(causal load balancing): activations and compute of {plan.seq_len // cp} tokens "
            f"per rank; K and V all-gathered over the cp group before each attention, their "
            f"gradients reduce-scattered after it: {F.fmt_time(p.cp_comm_s)} per step, "
            f"exposed; gradients reduced and ZeRO-sharded over dp x cp = {plan.mesh.dp_shard} "
            f"ranks")


def _offload_text(plan: Plan, topology) -> str:
    p = plan.prediction
    share = F.host_share_bytes(plan, topology)
    of = f" of {F.fmt_bytes(share)} per rank" if share else ""
    return (f"{plan.offload}: {F.OFFLOAD_TEXT[plan.offload]}; host memory "
            f"{F.fmt_bytes(p.host_memory_bytes)}{of}; transfers {F.fmt_time(p.offload_s)} "
            f"per step (exposed)")


def _sequence_text(plan: Plan, graph) -> str:
    """How much of the blocks' norm / dropout / residual-add region is split on the sequence
    dim ([Note: sequence parallelism] in autoplan/solver/sequence.py); "" at tp 1 or without
    the graph."""
    if graph is None or plan.mesh.tp == 1 or not graph.layer_nodes:
        return ""
    from autoplan.solver.sequence import placed, region_nodes, seq_dim

    on, total = placed(graph, plan)
    region = set(region_nodes(graph))
    outs = {f"`{st.outputs[0]}`" for st in plan.strategies if st.node in region and st.outputs}
    if not total:
        return ""
    split = f"`S({seq_dim(graph)})`"
    if on == total:
        return (f"on: all {total} norm, dropout and residual-add nodes of the captured blocks "
                f"are {split} on the tp axis (reduce-scatter after row-parallel matmuls, "
                f"all-gather before column-parallel ones; their activations 1/{plan.mesh.tp})")
    if on == 0:
        return (f"off: none of the {total} norm, dropout and residual-add nodes is {split}"
                f" (outputs: {', '.join(sorted(outs))})")
    return f"partial: {on} of {total} norm, dropout and residual-add nodes are {split}"


def _mesh(plan: Plan, topology) -> list[str]:
    rows = [[f"`{a.name}`", a.degree, a.stride, a.level, a.text]
            for a in F.mesh_axes(plan, topology)]
    if plan.mesh.ep > 1:  # [Note: expert parallelism]: ep groups are consecutive dp ranks
        ep_mesh = SimpleNamespace(mesh=MeshShape(1, plan.mesh.ep, plan.mesh.tp))
        dp = next(a for a in F.mesh_axes(ep_mesh, topology) if a.name == "dp")
        rows.insert(1, ["`ep` (in dp)", dp.degree, dp.stride, dp.level,
                        f"{dp.text}; all-to-all dispatch and combine of tokens"])
    return ["### Mesh axes on the topology", "",
            "Ranks are ordered (pp, dp, cp, tp), tp innermost, so a tp group is consecutive "
            "ranks (cp only when > 1).",
            "", *_table(["axis", "degree", "rank stride", "level", "groups"], rows)]


def _prediction(plan: Plan, topology) -> list[str]:
    p = plan.prediction
    step = p.step_time_s or 1.0
    rows = [
        ["step time", F.fmt_time(p.step_time_s),
         F.error_band_text(plan, "step_time", topology)],
        ["compute", F.fmt_time(p.compute_s), F.fmt_pct(p.compute_s / step)],
        ["communication (exposed)", F.fmt_time(p.comm_s), F.fmt_pct(p.comm_s / step)],
        *([["of which cp K/V all-gather + reduce-scatter", F.fmt_time(p.cp_comm_s),
            F.fmt_pct(p.cp_comm_s / step)]] if plan.mesh.cp > 1 else []),
        ["pipeline bubble", F.fmt_time(p.bubble_s), F.fmt_pct(p.bubble_s / step)],
        ["tokens/s", F.fmt_count(F.tokens_per_s(plan)), ""],
        ["model FLOPs per step", F.fmt_flops(p.model_flops), "fwd + bwd, no recompute"],
        ["model FLOP/s per device", F.fmt_flops(p.tflops_per_device * 1e12, per_s=True), ""],
        ["MFU", F.fmt_pct(p.mfu), f"of {topology.device.name} dense {plan.dtype} peak"
         if topology else "vs the device's dense peak"],
    ]
    return ["## Predicted step", "", *_table(["", "value", "share / note"], rows)]


def _memory(plan: Plan, topology, graph: CapturedGraph | None = None) -> list[str]:
    peak = plan.prediction.memory_bytes
    rows = [[k, F.fmt_bytes(v), F.fmt_pct(v / peak) if peak else ""]
            for k, v in F.memory_rows(plan)]
    rows.append(["**peak**", f"**{F.fmt_bytes(peak)}**",
                 F.error_band_text(plan, "peak_memory", topology)])
    lines = ["## Memory per rank", "",
             "The most loaded rank at its peak (the backward of its last layer for the oldest "
             "microbatch in flight)."
             + (" Gradients and optimizer states are those of the trainable parameters only; "
                "params holds the frozen ones too"
                + (f", in {plan.frozen_dtype}" if plan.frozen_dtype else ", as fp32 masters")
                + " ([Note: frozen pricing] in autoplan/cost_model/memory.py)."
                if F.trainable_text(plan, graph) else "")
             + (f" With cp {plan.mesh.cp} the activations are those of "
                f"{plan.seq_len // plan.mesh.cp} tokens per sample plus the keys and values "
                "of the whole sequence that attention gathered and saves for its backward; "
                f"parameters, gradients and optimizer states are sharded over dp x cp = "
                f"{plan.mesh.dp_shard} ranks by the ZeRO stage." if plan.mesh.cp > 1 else ""),
             "", *_table(["kind", "bytes", "share"], rows)]
    if topology is not None:
        mem = topology.device.mem_bytes
        lines += [f"Device memory: {F.fmt_bytes(mem)} per {topology.device.name}; the plan "
                  f"uses {F.fmt_pct(peak / mem)} of it.", ""]
    host = plan.prediction.host_memory_bytes
    if host:
        share = F.host_share_bytes(plan, topology)
        lines += [f"Host memory (offloaded {plan.offload}): {F.fmt_bytes(host)} per rank"
                  + (f", {F.fmt_pct(host / share)} of its share of the node's host memory "
                     f"({F.fmt_bytes(share)})" if share else "") + ".", ""]
    return lines


def _dry_run(plan: Plan, topology) -> list[str]:
    """The "Dry run" section (report/measured.py); [] when the plan records none."""
    if not plan.dry_run:
        return []
    band = M.memory_band(plan, topology)
    lines = ["## Dry run", "", M.intro_text(plan), ""]
    for r in plan.dry_run:
        axes = M.axis_rows(r)
        lines += [f"### Rank {r.rank} ({M.where_text(r)})", "",
                  *_table(["", "measured", "predicted", "error"], M.rank_rows(r)),
                  M.finding(r, band), "",
                  *(_table(["mesh axis", "collective bytes measured", "priced", "error"], axes)
                    + [M.traffic_finding(r), ""] if axes
                    else ["No collective or point-to-point op.", ""])]
    return lines


def _stages(plan: Plan) -> list[str]:
    last = len(plan.stages) - 1
    rows = []
    for st in plan.stages:
        extra = [x for x, on in (("embedding (before the blocks)", st.index == 0),
                                 ("head (after the blocks)", st.index == last)) if on]
        rows.append([st.index, st.index % plan.mesh.pp, st.index // plan.mesh.pp,
                     f"[{st.layer_start}, {st.layer_end})", st.num_layers, ", ".join(extra)])
    return ["## Pipeline stages", "",
            *_table(["stage", "pp rank", "chunk", "blocks", "# blocks", "also"], rows)]


def _placements(plan: Plan, graph) -> list[str]:
    groups = F.param_groups(plan, graph)
    rows = [[f"`{g.role}`" + (f" (tied to `{g.tied_to}`)" if g.tied_to else "")
             + (" (buffer)" if g.is_buffer else ""),
             "x".join(map(str, g.shape)) or "-", f"`{g.placement}`", g.count] for g in groups]
    return ["## Tensor-parallel placements", "",
            f"Placement of each parameter on the tp axis (tp = {plan.mesh.tp}); one row per "
            f"role in the repeated block. {_sharded_text(plan, graph)}.", "",
            *_table(["parameter", "shape", "placement", "count"], rows), *_region(plan, graph),
            *_pinned(plan)]


def _pinned(plan: Plan) -> list[str]:
    """The user's pins, one line ([Note: pinned placements] in solver/pins.py)."""
    if not plan.pinned and not plan.pinned_stages:
        return []
    return ["", "Pinned by the user (hard constraints of the search): "
            + ", ".join([f"`{p}` `{q}`" for p, q in plan.pinned]
                        + ([f"stages of {_stage_blocks(plan)} blocks"]
                           if plan.pinned_stages else [])) + "."]


def _stage_blocks(plan: Plan) -> str:
    """Blocks per stage in stage order, "3/1"; a run of equal stages as "2x12"."""
    return blocks_text(s.num_layers for s in plan.stages)


def _region(plan: Plan, graph) -> list[str]:
    """The placements of the first captured block's norm / dropout / residual-add nodes (the
    sequence-parallel region), one line; nothing at tp 1 or without the graph."""
    if graph is None or plan.mesh.tp == 1 or not graph.layer_nodes:
        return []
    from autoplan.solver.sequence import region_nodes

    first_block = min(graph.layer_nodes)
    first = set(graph.layer_nodes[first_block])
    outs = {st.node: st.outputs[0] for st in plan.strategies if st.outputs}
    prefix = f"{graph.block_path(first_block)}."
    roles: dict[tuple[str, str], list[str]] = {}  # (module in the block, placement) -> ops
    for n in region_nodes(graph):
        if n not in first or n not in outs:
            continue
        info = graph.nodes.get(n)
        path = (info.module_path if info is not None else "").removeprefix(prefix)
        path = "" if path == prefix[:-1] else path  # the block's own ops: its residual adds
        op = (info.target if info is not None else n).split(".")[1] \
            if info is not None and info.target.startswith("aten.") else n
        ops = roles.setdefault((path or "the block (residual adds)", outs[n]), [])
        if op not in ops:
            ops.append(op)
    cells = [f"`{path}` ({', '.join(ops)}) `{placement}`"
             for (path, placement), ops in roles.items()]
    if not cells:
        return []
    return ["", "Norm, dropout and residual-add outputs of the first block (the sequence-"
                "parallel region; `S(1)` = split on the sequence dim): " + ", ".join(cells)
            + "."]


def _sharded_text(plan: Plan, graph) -> str:
    """"37 of 148 parameters sharded on the tp axis (...)": the one phrasing of the count,
    in the report and the summary (F.sharded_params)."""
    sharded, total = F.sharded_params(plan, graph)
    # without the graph the plan's names are all there is: captured blocks only, a tied
    # weight under each of its names (F.sharded_params)
    what = "a tied weight counted once, no buffers" if graph is not None else \
        "per name in the plan"
    return f"{sharded} of {F.plural(total, 'parameter')} sharded on the tp axis ({what})"


def _redistributions(plan: Plan, graph) -> list[str]:
    groups = F.redistribution_groups(plan, graph)
    lines = ["## Redistributions", ""]
    if not groups:
        return lines + ["The plan inserts no redistribution on the tp axis.", ""]
    m = plan.num_microbatches
    rows = [[g.where, f"`{g.edge}`", f"`{g.src}` -> `{g.dst}`", g.collective,
             F.fmt_bytes(g.bytes), F.fmt_time(g.time_s), g.count,
             F.fmt_time(g.time_s * g.count * m)] for g in groups]
    total = sum(g.time_s * g.count * m for g in groups)
    return lines + [
        f"Every placement change the solver costed and the passes insert, grouped per block "
        f"role. Times are forward, per occurrence, for one microbatch of "
        f"{F.plural(plan.microbatch_size, 'sample')}; the last column sums count x "
        f"{F.plural(m, 'microbatch')} over all stages ({F.fmt_time(total)} in all: forward "
        f"only and every stage's together, so not the step's exposed communication, which is "
        f"{F.fmt_time(plan.prediction.comm_s)} on the busiest pp rank).", "",
        *_table(["consumer", "edge (first occurrence)", "placements", "collective",
                 "bytes each", "time each", "count", "per step"], rows)]


def _parts(plan: Plan, parts: list[F.PartCost] | None) -> list[str]:
    if parts is None:
        return []
    names = {"pre": "before the blocks", "block": "one block", "post": "after the blocks"}
    rows = [[names[p.part], p.count, F.fmt_time(p.compute_fwd_s), F.fmt_time(p.compute_bwd_s),
             F.fmt_time(p.comm_fwd_s), F.fmt_time(p.comm_bwd_s)] for p in parts]
    p2p = plan.prediction.p2p_s
    recomputed = busiest_rank_s(plan, *stage_costs(plan, parts)) + p2p
    predicted = predicted_stage_s(plan)
    transfers = f" and {F.fmt_time(p2p)} of pipeline transfers" if p2p else ""
    check = (f"Cross-check: these parts{transfers} give the busiest pp rank "
             f"{F.fmt_time(recomputed)} per microbatch; the solver's prediction is "
             f"{F.fmt_time(predicted)}.")
    if not plan.prediction.stage_time_s:  # a plan from before Prediction.stage_time_s
        check += (" (The prediction is read off the step: it also holds pipeline transfers "
                  "and, with pp = 1, the exposed gradient sync and the optimizer step.)")
    if predicted > 0 and abs(recomputed / predicted - 1) > 0.02:
        check = f"**Check: they differ by {F.fmt_pct(recomputed / predicted - 1)}.** " + check
    return ["## Compute and communication per part", "",
            "One microbatch on one rank, recomputed from the plan's placements with the cost "
            "model; communication is the tp redistributions only (the dp gradient sync and "
            "pipeline transfers are in the step totals).", "",
            *_table(["part", "count", "compute fwd", "compute bwd", "comm fwd", "comm bwd"],
                    rows), check, ""]


def _alternatives(plan: Plan) -> list[str]:
    lines = ["## Alternatives", ""]
    if not plan.alternatives:
        return lines + ["The solver kept no runner-up.", ""]
    step = plan.prediction.step_time_s
    rows = [["**chosen**", F.mesh_text(plan.mesh),
             plan.zero_stage, plan.num_microbatches,
             _schedule(plan.schedule, plan.num_virtual_stages), plan.checkpointing,
             plan.offload, F.fmt_time(step), "", F.fmt_bytes(plan.prediction.memory_bytes),
             ""]]
    for a in plan.alternatives:
        delta = F.fmt_pct(a.step_time_s / step - 1, sign=True) if step else ""
        rows.append(["", F.mesh_text(a.mesh), a.zero_stage,
                     a.num_microbatches, _schedule(a.schedule, a.num_virtual_stages),
                     a.checkpointing, a.offload, F.fmt_time(a.step_time_s), delta,
                     F.fmt_bytes(a.memory_bytes), a.reason])
    return lines + _table(["", "mesh", "ZeRO", "microbatches", "schedule", "checkpointing",
                           "offload", "step time", "vs chosen", "memory", "why it loses"], rows)


def _schedule(schedule: str, num_virtual_stages: int) -> str:
    return f"{schedule} (v = {num_virtual_stages})" if num_virtual_stages > 1 else schedule


def _formulas(plan: Plan) -> list[str]:
    formulas, symbols = plan_formulas(plan)
    lines = ["## Formulas", "",
             "The closed forms of the cost model (autoplan.cost_model.symbolic) that this plan's "
             "configuration uses; symbols: "
             + ", ".join(f"{k} = {v}" for k, v in symbols.items()) + ".", ""]
    for f in formulas:
        value = f" = {F.fmt_count(f.value)} for this plan" if f.value is not None else ""
        lines += [f"### `{f.name}`{value}", "", f"Source: {f.source}.", "",
                  f"    {f.text}", "", f"$$ {f.latex} $$", ""]
    return lines


def markdown_sections(plan: Plan, graph: CapturedGraph | None = None,
                      topology: Topology | None = None,
                      parts: list[F.PartCost] | None = None,
                      dtype_origin: str = "") -> list[tuple[str, list[str]]]:
    """The report as (section key, Markdown lines); html.py adds a chart to some keys.
    `parts`: F.part_costs(plan, graph, topology), computed here when None and both given;
    `dtype_origin`: where the plan's dtype came from, in words ("the checkpoint's dtype",
    "as given, cast from the checkpoint's bfloat16": AutoParallel.dtype_origin)."""
    if parts is None and graph is not None and topology is not None:
        parts = F.part_costs(plan, graph, topology)
    return [("summary", _summary(plan, graph, topology, dtype_origin)),
            ("mesh", _mesh(plan, topology)),
            ("prediction", _prediction(plan, topology)),
            ("memory", _memory(plan, topology, graph)),
            *([("dry_run", _dry_run(plan, topology))] if plan.dry_run else []),
            ("stages", _stages(plan)), ("placements", _placements(plan, graph)),
            ("redistributions", _redistributions(plan, graph)), ("parts", _parts(plan, parts)),
            ("alternatives", _alternatives(plan)), ("formulas", _formulas(plan))]


def render_markdown(plan: Plan, *, graph: CapturedGraph | None = None,
                    topology: Topology | None = None, dtype_origin: str = "") -> str:
    """The plan report as Markdown (see module docstring). `graph` adds parameter counts,
    shapes, block roles and per-part costs; `topology` adds the device memory and the
    topology level of each mesh axis; `dtype_origin`: where the dtype came from
    (`markdown_sections`). Raises ValueError from the cost model."""
    lines = [line for _, section in markdown_sections(plan, graph, topology,
                                                      dtype_origin=dtype_origin)
             for line in section]
    return "\n".join(lines).rstrip() + "\n"


def render_summary(plan: Plan, *, topology: Topology | None = None,
                   graph: CapturedGraph | None = None) -> str:
    """A few lines for a terminal: model, mesh and levels, schedule, tp sharding, step time,
    memory, MFU, in the report's number format ([Note: number format] in facts.py). Pass the
    `graph` the report gets so that both count parameters alike (`_sharded_text`)."""
    p = plan.prediction
    lines = [f"plan        {plan.model} on {plan.topology}: {plan.mesh}",
             f"mesh        {F.mesh_text(plan.mesh)} = "
             f"{F.plural(plan.mesh.world_size, 'rank')}"]
    for a in F.mesh_axes(plan, topology):
        lines.append(f"  {a.name} {a.degree:>4}  {a.text}")
    if ex := F.experts_text(plan, graph):
        lines.append(f"experts     {ex}")
    lines += [
        f"ZeRO        {zero_text(plan)}",
        f"schedule    {plan.schedule}"
        + (f" ({plan.num_virtual_stages} chunks per pp rank)" if plan.num_virtual_stages > 1
           else "") + F.searched_split(plan)
        + f", {F.plural(plan.num_microbatches, 'microbatch')} of "
          f"{F.plural(plan.microbatch_size, 'sample')}",
        f"precision   {plan.dtype}"
        + (f" with {F.plural(len(plan.float8_linears), 'linear')} in FP8 (float8 recipe)"
           if plan.float8_linears else "")
        + f"; activation checkpointing {plan.checkpointing}"
        + ("" if plan.offload == "none" else f"; {plan.offload} offloaded to the host")
        + ("; compiled (torch.compile)" if plan.compiled else ""),
        f"params      {_sharded_text(plan, graph)}; "
        f"{F.plural(len(plan.redistributions), 'redistribution')}",
        *(["pinned      " + ", ".join([f"{p}={q}" for p, q in plan.pinned]
                                      + ([f"stages={_stage_blocks(plan)}"]
                                         if plan.pinned_stages else []))]
          if plan.pinned or plan.pinned_stages else []),
        *([f"trains      {tt}"] if (tt := F.trainable_text(plan, graph, short=True)) else []),
        f"step time   {F.fmt_time(p.step_time_s)} (compute {F.fmt_time(p.compute_s)}, "
        f"communication {F.fmt_time(p.comm_s)}, bubble {F.fmt_time(p.bubble_s)})",
        f"throughput  {F.fmt_count(F.tokens_per_s(plan))} tokens/s, "
        f"{F.fmt_flops(p.tflops_per_device * 1e12, per_s=True)} per device, "
        f"MFU {F.fmt_pct(p.mfu)}"]
    mem = f"memory      {F.fmt_bytes(p.memory_bytes)} per device (peak rank)"
    if topology is not None:
        mem += (f" of {F.fmt_bytes(topology.device.mem_bytes)} on {topology.device.name} "
                f"({F.fmt_pct(p.memory_bytes / topology.device.mem_bytes)})")
    from autoplan.cost_model.fidelity import uncovered

    why = uncovered(plan, topology.device.name if topology is not None else None)
    bands = [f"{what} {b['low'] * 100:+.0f}% to {b['high'] * 100:+.0f}%" if kind not in why
             else f"{what}: no measured band ({why[kind]})"
             for what, kind, b in (("step time", "step_time", p.error_bands.get("step_time")),
                                   ("memory", "peak_memory", p.error_bands.get("peak_memory")))
             if b]
    if p.host_memory_bytes:
        share = F.host_share_bytes(plan, topology)
        mem += (f"\nhost memory {F.fmt_bytes(p.host_memory_bytes)} per rank (offloaded "
                f"{plan.offload})" + (f" of {F.fmt_bytes(share)}" if share else "")
                + f"; transfers {F.fmt_time(p.offload_s)} per step")
    if bands:
        mem += "\nband        " + ", ".join(bands) + " (predicted vs measured; see the report)"
    return "\n".join(lines + [mem])
