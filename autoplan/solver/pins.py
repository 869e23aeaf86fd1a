"""Pinned placements: the user fixes a parameter's placement on the tp axis.

[Note: pinned placements]
`plan(placements={"lm_head.weight": "S(0)", "model.embed_tokens.weight": "R"})` (the CLI's
`--place PATTERN=PLACEMENT`, `@autoparallel(placements=...)`): each pattern is a shell-style
glob (`fnmatch`) over parameter FQNs -- a tied weight's every name -- and each placement the
field's notation on the tp axis, "R" or "S(d)" with d a dim of the parameter (a parameter is
never Partial). A pin is a hard constraint of the placement ILP: the candidates of the
parameter's node are cut to those that produce the pinned placement (`restrict`), so the ILP
prices and chooses everything around it; the plan records the pins (`Plan.pinned`).

- Blocks share their placement variables ([Note: layer sharing] in solver/problem.py), so a
  pin on a block's parameter must hold for that parameter in every block of the model
  (`model.layers.*.mlp.up_proj.weight`); one that matches some blocks only is refused.
- At tp 1 every tensor is whole: a pin other than "R" takes the search to the meshes with
  tp > 1 (search.enumerate_configs), and "R" pins are trivially met there.
- Refused before any solve (ValueError): a pattern that matches no parameter, a placement not
  in the notation, two pins of one parameter that disagree, a pin on some blocks only, and at
  a tp degree a pin no strategy of the node can take (a dim the tp degree does not divide, or
  out of the parameter's range), naming the pin, the parameter, its shape and the tp degree.
"""

from __future__ import annotations

import fnmatch
import re

from autoplan.graph import CapturedGraph
from autoplan.strategies.nodes import vocab_nodes

__all__ = ["parse_pins", "pinned_params", "restrict", "needs_tp", "why_not"]

_PLACEMENT = re.compile(r"^(R|S\((-?\d+)\))$")


def parse_pins(placements) -> tuple[tuple[str, str], ...]:
    """`placements` ({pattern: placement}, an iterable of (pattern, placement) pairs, or
    "PATTERN=PLACEMENT" strings; None: no pins) as sorted (pattern, placement) pairs.
    Raises ValueError for a placement outside the notation or an empty pattern."""
    if not placements:
        return ()
    if isinstance(placements, dict):
        items = list(placements.items())
    else:
        items = []
        for item in placements:
            if isinstance(item, str):
                pattern, sep, placement = item.partition("=")
                if not sep:
                    raise ValueError(f"placements: {item!r}; expected PATTERN=PLACEMENT, e.g. "
                                     "lm_head.weight=S(0)")
                items.append((pattern, placement))
            else:
                items.append(tuple(item))
    out = {}
    for pattern, placement in items:
        pattern, placement = str(pattern).strip(), str(placement).strip().replace(" ", "")
        if not pattern:
            raise ValueError("placements: an empty pattern; give a parameter FQN or a glob "
                             "such as model.layers.*.mlp.up_proj.weight")
        if not _PLACEMENT.match(placement):
            raise ValueError(f"placements: {pattern}={placement}; a parameter's placement on "
                             "the tp axis is R or S(d) (d: the dim split), e.g. S(0)")
        if out.get(pattern, placement) != placement:
            raise ValueError(f"placements: {pattern} pinned twice, to {out[pattern]} and "
                             f"{placement}")
        out[pattern] = placement
    return tuple(sorted(out.items()))


def needs_tp(pins: tuple[tuple[str, str], ...]) -> bool:
    """Whether a pin asks for a split (then only meshes with tp > 1 are searched)."""
    return any(p != "R" for _, p in pins)


def pinned_params(graph: CapturedGraph, pins: tuple[tuple[str, str], ...]) -> dict[str, tuple]:
    """Canonical FQN of each pinned parameter of `graph` -> (placement, pattern), blocks'
    parameters under their captured names. Raises ValueError as [Note: pinned placements]
    says (a pattern matching nothing, conflicting pins, a pin on some blocks only)."""
    if not pins:
        return {}
    total = graph.total_layers if graph.num_layers else 0
    prefix = graph.layer_prefix
    matched: dict[str, int] = {pattern: 0 for pattern, _ in pins}
    out: dict[str, tuple] = {}
    for fqn, info in graph.params.items():
        if info.is_buffer:
            continue
        names = (fqn, *info.aliases)
        for pattern, placement in pins:
            if info.layer_id is not None and prefix and total:
                own = f"{graph.block_path(info.layer_id)}."
                rest = [n.removeprefix(own) for n in names if n.startswith(own)]
                hits = [any(fnmatch.fnmatchcase(f"{graph.block_path(k)}.{r}", pattern)
                            for r in rest) for k in range(total)]
                if any(hits) and not all(hits):
                    some = [k for k, h in enumerate(hits) if h]
                    raise ValueError(
                        f"placements: {pattern} matches {graph.block_path(some[0])}.{rest[0]} "
                        f"but not "
                        f"the same parameter in every block ({len(some)} of {total}); blocks "
                        f"share their placements, so pin it in all of them, e.g. "
                        f"{prefix}.*.{rest[0]}")
                hit = all(hits)
            else:
                hit = any(fnmatch.fnmatchcase(n, pattern) for n in names)
            if not hit:
                continue
            matched[pattern] += 1
            if fqn in out and out[fqn][0] != placement:
                raise ValueError(f"placements: {fqn} is pinned to {out[fqn][0]} by "
                                 f"{out[fqn][1]} and to {placement} by {pattern}")
            out.setdefault(fqn, (placement, pattern))
    unmatched = [p for p, n in matched.items() if n == 0]
    if unmatched:
        some = ", ".join(list(f for f, i in graph.params.items() if not i.is_buffer)[:4])
        raise ValueError(f"placements: {unmatched[0]} matches no parameter of "
                         f"{graph.model_name} (its parameters are named like {some}, ...)")
    return out


def _vocab_of(graph: CapturedGraph, fqn: str) -> int | None:
    """The vocabulary size when parameter `fqn` carries the vocabulary (`vocab_nodes`), else
    None."""
    carry = vocab_nodes(graph)
    read = any(n.op == "get_attr" and n.target == fqn and n.name in carry
               for n in graph.gm.graph.nodes)
    return graph.vocab_size if read else None


def _split_reason(shape: tuple, placement: str, tp: int, vocab: int | None) -> str | None:
    """Why `placement` cannot split a parameter of `shape` over `tp` ranks, or None. A dim of
    `vocab` rows (the parameter holds the vocabulary, else None) splits unevenly ([Note:
    uneven vocabulary] in strategies/probe.py)."""
    m = re.match(r"S\((-?\d+)\)", placement)
    if not m or tp == 1:
        return None
    d = int(m.group(1))
    if not -len(shape) <= d < len(shape):
        return f"the parameter has {len(shape)} dims"
    if shape[d] < tp or (shape[d] % tp and shape[d] != vocab):
        return f"dim {d % len(shape)} of size {shape[d]} does not split over {tp} ranks"
    return None


def why_not(graph: CapturedGraph, pinned: dict[str, tuple], tp: int) -> str | None:
    """Why the pins cannot all hold at tp degree `tp` (the first pin that cannot, named with
    its parameter, shape and reason), or None when they can."""
    for fqn, (placement, pattern) in pinned.items():
        shape = tuple(graph.params[fqn].shape)
        why = _split_reason(shape, placement, tp, _vocab_of(graph, fqn))
        if why:
            return f"placements: {pattern}={placement} cannot hold for {fqn} {shape} at tp " \
                   f"{tp}: {why}"
    return None


def restrict(problem, pinned: dict[str, tuple]) -> None:
    """Cut the candidates of every pinned parameter's node of `problem` (solver/problem.py,
    in place; new lists: the strategy cache's are shared) to the pinned placement. A no-op at
    tp 1. Raises ValueError naming the pin, the parameter, its shape and the tp degree when
    no candidate has that placement."""
    if problem.tp == 1 or not pinned:
        return
    graph = problem.graph
    for node, (fqn, *_rest) in problem.params.items():
        if fqn not in pinned:
            continue
        placement, pattern = pinned[fqn]
        keep = [c for c in problem.cands[node] if c.outputs[0] == placement]
        if not keep:
            shape = tuple(graph.params[fqn].shape)
            why = _split_reason(shape, placement, problem.tp, _vocab_of(graph, fqn))
            raise ValueError(f"placements: {pattern}={placement} cannot hold for {fqn} "
                             f"{shape} at tp {problem.tp}"
                             + (f": {why}" if why else ": no strategy of its node places it so")
                             + "; pin another placement or fix a tp that allows it (--tp)")
        if placement != "R":  # a split parameter is used as it is stored (solver/costs.py)
            for e in problem.edges:
                if e.src != node or e.dst not in problem.cands:
                    continue
                takes = sorted({c.inputs[e.arg_index] for c in problem.cands[e.dst]})
                if placement not in takes:
                    info = graph.nodes.get(e.dst)
                    what = info.target if info is not None else e.dst
                    tied = (f" (the tensor of {', '.join(graph.params[fqn].aliases)})"
                            if graph.params[fqn].aliases else "")
                    raise ValueError(
                        f"placements: {pattern}={placement} cannot hold for {fqn}{tied} at tp "
                        f"{problem.tp}: {e.dst} ({what}) reads it at {' or '.join(takes)} "
                        "only, and a split parameter is used as it is stored; pin one of "
                        "those, or leave it to the planner")
        # every node the ILP node stands for (the other blocks' copies): assembly reads a
        # block's choice by its index into these lists, so they are cut alike
        for name in [n for n, r in problem.rep.items() if r == node]:
            problem.cands[name] = [c for c in problem.cands[name] if c.outputs[0] == placement]
        problem.cands[node] = keep
