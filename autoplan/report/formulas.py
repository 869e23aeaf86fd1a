"""Which closed-form formulas of `autoplan.cost_model.symbolic` a plan's configuration uses,
as text and LaTeX with their sources, evaluated where the plan fixes every symbol."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.plan import Plan

__all__ = ["FormulaFacts", "plan_formulas"]


@dataclass(frozen=True)
class FormulaFacts:
    """One formula: its name in symbolic.FORMULAS, plain text, LaTeX, source, and its value
    for the plan when the plan fixes all its symbols (else None)."""

    name: str
    text: str
    latex: str
    source: str
    value: float | None


def _names(plan: Plan) -> list[str]:
    m = plan.mesh
    names = ["model_flops", f"zero_stage{plan.zero_stage}_bytes"]
    names.append({"selective": "act_layer_tp_selective",
                  "full": "act_layer_full_recompute"}.get(
        plan.checkpointing, "act_layer_tp" if m.tp > 1 else "act_layer"))
    if m.pp > 1:
        if plan.schedule == "interleaved-zb":  # its memory: [Note: zero-bubble memory]
            names += ["bubble_fraction_zero_bubble"]
        elif plan.num_virtual_stages > 1:
            names += ["bubble_fraction_interleaved", "interleaved_act_factor"]
        else:
            names += ["bubble_fraction"]
        if plan.schedule in ("1f1b", "interleaved-1f1b"):
            names.append("act_first_stage_1f1b")
        names.append("send_recv_time")
    if m.tp > 1:
        names.append("tp_allreduce_bytes_per_layer")
        names += [f"{r.collective}_time" for r in plan.redistributions]
    if m.dp_shard > 1:  # the ZeRO / gradient group: dp x cp ranks
        names += ["all_reduce_time"] if plan.zero_stage == 0 else \
            ["reduce_scatter_time", "all_gather_time"]
    return list(dict.fromkeys(names))  # unique, in order


def plan_formulas(plan: Plan) -> tuple[list[FormulaFacts], dict[str, str]]:
    """(the formulas the plan's configuration uses, {symbol: meaning} of their symbols)."""
    from autoplan.cost_model.symbolic import FORMULAS, SOURCES, SYMBOL_DOCS, evaluate, latex

    known = {"p": plan.mesh.pp, "d": plan.mesh.dp_shard, "t": plan.mesh.tp, "z": plan.zero_stage,
             "m": plan.num_microbatches, "v": plan.num_virtual_stages, "B": plan.global_batch,
             "s": plan.seq_len, "b": plan.microbatch_size}
    out, symbols = [], set()
    for name in _names(plan):
        if name not in FORMULAS:
            continue  # e.g. a collective the symbolic module does not write out ("slice")
        expr = FORMULAS[name]
        free = {str(x) for x in expr.free_symbols}
        symbols |= free
        value = evaluate(name, **{k: known[k] for k in free}) if free <= known.keys() else None
        out.append(FormulaFacts(name, str(expr), latex(name), SOURCES.get(name, "-"), value))
    docs = {k: v for k, v in SYMBOL_DOCS.items() if k in symbols}
    return out, docs
