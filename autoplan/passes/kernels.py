"""Fuse the patterns the Triton kernels implement into calls of them, in a rewritten stage graph.

[Note: kernel fusion] After `apply_placements` (the graph is interpreted under DTensor), two
patterns of the captured aten graph become one call each of a registered op (kernels/ops.py:
`torch.ops.autoplan.*`, a Triton kernel on CUDA, the torch reference on CPU):

  RMSNorm, Hugging Face LlamaRMSNorm's spelling (x (..., H), weight (H,)):
      a = to.dtype(x, float32)            (absent when x is already the accumulation dtype)
      r = rsqrt(add(mean.dim(pow(a, 2), [-1], True), eps))
      y = mul(weight, to.dtype(mul(a, r), x.dtype))        -> rms_norm_local(x, weight, eps)
      (both casts absent when x is in the accumulation dtype: capture drops a cast to the
      dtype its input already has)
  SwiGLU gating (Shazeer 2020, eq. 6), gate and up of one shape and dtype:
      y = mul(silu(gate), up)                              -> swiglu_local(gate, up)

Every intermediate of a pattern must have no reader outside it (the fused op does not produce
them), so a graph that reads `rsqrt` elsewhere keeps its pattern unfused. A redistribution the plan
inserted inside a pattern also keeps it unfused: the fused op is local, and the plan's costed
collectives stay where they are.

Under DTensor, `rms_norm_local` / `swiglu_local` run the op on the local shards when that is the
same math as the unfused ops under DTensor's rules: RMSNorm on x Replicate or Shard(d), d not the
normalized (last) dim, with a Replicate weight (whose local gradient is then a Partial sum over the
shards, as DTensor's rule for the unfused `mul` gives it); SwiGLU on gate and up in one placement
that is not Partial (elementwise). Any other placement runs the torch reference under DTensor,
which is the unfused ops themselves.

The routed experts need no rewrite here: capture already makes each MoE layer's experts one
node, `torch.ops.autoplan.experts` ([Note: experts op]), which `experts_local` (or, under ep,
runtime/expert_parallel.py) calls on local tensors. The op's impl is the kernel choice: the Triton
grouped GEMM (kernels/grouped_gemm.py) on CUDA tensors, its eager reference elsewhere, as
`pick_triton` rules with use_triton None; its backward op likewise. Rewriting the node into a
second op would leave two ops for one computation, each place that reads it (strategies,
costs, ep routing) to be taught both. So the `kernels` option (lowering's `LoweringOptions`)
does not reach the experts: what they run follows the tensors' device, and on CPU ranks it is
the reference whichever way the option is set.

Pricing. The plan is made on the captured graph, before this pass, and does not change with it.
On devices that fuse (`DeviceSpec.fuses_pointwise`: the GPU presets) the cost model already
prices each chain of pointwise ops and row reductions as one kernel that reads the chain's
inputs and writes what leaves it ([Note: pointwise fusion] in capture/fusion.py, `fused_bytes`;
its backward at compute.BACKWARD_BYTES_FACTOR times that). For a SwiGLU, whose gate and up come
from matmuls and whose output feeds one, that is exactly the fused op's memory pass: gate + up
read, y written. For an RMSNorm whose input comes from a non-fusible op (the embedding) it is
x + weight read, y written: the Triton kernel's pass (plus its (N,) rstd, not counted). A norm
after a residual add is priced inside the add's chain (torch.compile fuses add + norm): the
model counts weight + y only, while the Triton kernel starts at the norm, so the add writes x and
the kernel reads it again: 2 * N * H * bytes more per norm than priced, unless the stage is also
compiled. tests/test_kernel_pass.py checks these sums on llama-tiny. On CPU ranks
(fuses_pointwise False) each op is priced as its own kernel, and the ops' CPU path is the torch
reference, op by op: what is priced is what runs.

[Note: vocab-parallel loss] The third kernel is the loss. When the plan shards the LM head by
vocabulary, its logits are Shard(-1) on tp and the plan all-gathers them before the graph output
(a costed redistribution, consumer "output"), then the runtime's token loss is F.cross_entropy
on the whole (B, T, V) logits on every tp rank. `keep_logits_sharded` drops that all-gather from
the last stage (runtime/engine.py, tp > 1, pp 1, the token loss: not a user's loss_fn, which
takes the whole logits, nor a model's own loss), and StepInputs.token_loss runs
kernels.vocab_parallel_cross_entropy on the shard: two all-reduces of (N,) statistics over tp
(Shoeybi et al. 2019, sec. 3). The lint (check_redistributions) leaves that one record out on
both sides; eval_batch all-gathers the logits it returns. The plan is not re-priced: its step
time still counts the all-gather of B * T * V elements (and not the 3N-element all-reduces), and
its memory the whole logits on each rank, so it is pessimistic there by (1 - 1/tp) of the logits.
Under pp > 1 the last stage keeps the all-gather (the pipeline schedule's output buffers are the
replicated logits' shape).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Partial, Replicate

from autoplan.passes.sharding import redistribute, tensor_args

__all__ = ["fuse_kernels", "kernel_patterns", "keep_logits_sharded", "rms_norm_local",
           "swiglu_local", "FUSED_OPS"]

aten = torch.ops.aten

FUSED_OPS = ("rms_norm", "swiglu")  # the keys of fuse_kernels' counts


def _ops():
    import kernels.ops  # noqa: F401 - registers torch.ops.autoplan.* (imports triton: lazily)

    return torch.ops.autoplan


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch._prims_common.make_contiguous_strides_for(shape)


def rms_norm_local(x, weight, eps: float):
    """RMSNorm (x (..., H), weight (H,)) as `torch.ops.autoplan.rms_norm`, on local shards under
    DTensor where that is exact (see [Note: kernel fusion]); returns (..., H) in x's placement."""
    import kernels

    ops = _ops()
    if not isinstance(x, DTensor) and not isinstance(weight, DTensor):
        return ops.rms_norm(x, weight, eps)
    if not (isinstance(x, DTensor) and isinstance(weight, DTensor)
            and x.device_mesh == weight.device_mesh
            and all(p.is_replicate() for p in weight.placements)
            and all(p.is_replicate() or (p.is_shard() and p.dim % x.ndim != x.ndim - 1)
                    for p in x.placements)):
        return kernels.rms_norm_reference(x, weight, eps)
    # A shard of the rows gives a share of the weight's gradient: Partial over that mesh axis.
    grad_placements = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    y = ops.rms_norm(x.to_local(), weight.to_local(grad_placements=grad_placements), eps)
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=_contiguous_stride(x.shape))


def swiglu_local(gate, up):
    """silu(gate) * up as `torch.ops.autoplan.swiglu`, on local shards under DTensor when gate
    and up share one placement that is not Partial; returns gate's shape and placement."""
    import kernels

    ops = _ops()
    if not isinstance(gate, DTensor) and not isinstance(up, DTensor):
        return ops.swiglu(gate, up)
    if not (isinstance(gate, DTensor) and isinstance(up, DTensor)
            and gate.device_mesh == up.device_mesh and gate.placements == up.placements
            and not any(p.is_partial() for p in gate.placements)):
        return kernels.swiglu_reference(gate, up)
    y = ops.swiglu(gate.to_local(), up.to_local())
    return DTensor.from_local(y, gate.device_mesh, gate.placements, run_check=False,
                              shape=gate.shape, stride=_contiguous_stride(gate.shape))


def _only_user(node: torch.fx.Node, target) -> torch.fx.Node | None:
    """The single reader of `node` when it is a call of `target`, else None."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target is target:
        return users[0]
    return None


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _other(node: torch.fx.Node, one: torch.fx.Node):
    """The argument of binary `node` that is not `one` (None when both are)."""
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def _match_rms_norm(r: torch.fx.Node):
    """(x, weight, eps, [pattern nodes], output node) of the RMSNorm around rsqrt `r`, or None."""
    e = r.args[0]
    if not (isinstance(e, torch.fx.Node) and e.target is aten.add.Tensor and len(e.users) == 1
            and isinstance(e.args[1], (int, float))):
        return None
    m = e.args[0]
    if not (isinstance(m, torch.fx.Node) and m.target is aten.mean.dim and len(m.users) == 1):
        return None
    p = m.args[0]
    a_val = _val(p)
    keepdim = m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)
    if a_val is None or not keepdim or list(m.args[1]) not in ([-1], [a_val.ndim - 1]):
        return None
    if not (p.target is aten.pow.Tensor_Scalar and p.args[1] == 2 and len(p.users) == 1):
        return None
    a = p.args[0]
    n = next((u for u in r.users if u.target is aten.mul.Tensor), None)
    if len(r.users) != 1 or n is None or _other(n, r) is not a or len(n.users) != 1:
        return None
    # the cast back to x's dtype is absent when x is in the accumulation dtype already (capture
    # leaves a cast to the dtype its input has out of the graph: capture/clean.py)
    c = _only_user(n, aten.to.dtype)
    y = _only_user(c if c is not None else n, aten.mul.Tensor)
    if y is None:
        return None
    weight = _other(y, c if c is not None else n)
    casts = [c] if c is not None else []
    if a.op == "call_function" and a.target is aten.to.dtype and set(a.users) <= {p, n}:
        x, nodes = a.args[0], [a, p, m, e, r, n, *casts, y]
    else:
        x, nodes = a, [p, m, e, r, n, *casts, y]
    x_val, w_val = _val(x), _val(weight)
    if x_val is None or w_val is None or w_val.shape != x_val.shape[-1:]:
        return None
    acc = torch.float64 if torch.float64 in (x_val.dtype, w_val.dtype) else torch.float32
    back = c.args[1] if c is not None else a_val.dtype
    if a_val.dtype != acc or back != x_val.dtype:
        return None  # not the reference's precision: normalize in acc, cast back to x's dtype
    return x, weight, float(e.args[1]), nodes


def _match_swiglu(s: torch.fx.Node):
    """(gate, up, [pattern nodes]) of the gating around silu `s`, or None."""
    y = _only_user(s, aten.mul.Tensor)
    if y is None:
        return None
    gate, up = s.args[0], _other(y, s)
    g_val, u_val = _val(gate), _val(up)
    if g_val is None or u_val is None or g_val.shape != u_val.shape or g_val.dtype != u_val.dtype:
        return None
    return gate, up, [s, y]


def _replace(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], fn, args) -> None:
    out = nodes[-1]
    with gm.graph.inserting_before(out):
        fused = gm.graph.call_function(fn, args)
    fused.meta = dict(out.meta)  # orig_name: the block and the plan's strategy of the output
    fused.meta["fused_nodes"] = [n.meta.get("orig_name", n.name) for n in nodes]
    out.replace_all_uses_with(fused)
    for node in reversed(nodes):
        gm.graph.erase_node(node)


def kernel_patterns(gm: torch.fx.GraphModule | torch.fx.Graph
                    ) -> list[tuple[str, tuple, list[torch.fx.Node]]]:
    """The RMSNorm and SwiGLU patterns of `gm` ([Note: kernel fusion]), in graph order: (op
    of FUSED_OPS, the fused op's arguments, the pattern's nodes, its output last). Matched on a
    captured graph, they are what `fuse_kernels` fuses once no redistribution cuts them (the
    cost model's traffic.py asks which)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    out, taken = [], set()
    for node in graph.nodes:
        if node.op != "call_function" or node in taken:
            continue
        match = None
        if node.target is aten.rsqrt.default:
            match = _match_rms_norm(node)
            if match is not None:
                x, weight, eps, nodes = match
                match = ("rms_norm", (x, weight, eps), nodes)
        elif node.target is aten.silu.default:
            match = _match_swiglu(node)
            if match is not None:
                gate, up, nodes = match
                match = ("swiglu", (gate, up), nodes)
        if match is not None:
            out.append(match)
            taken.update(match[2])
    return out


def fuse_kernels(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Replace the RMSNorm and SwiGLU patterns of `gm` (in place) with `rms_norm_local` /
    `swiglu_local` calls ([Note: kernel fusion]). Returns the number of calls by op
    (FUSED_OPS) and `replaced_nodes`, the aten nodes they replace."""
    counts = dict.fromkeys(FUSED_OPS, 0)
    counts["replaced_nodes"] = 0
    erased: set[torch.fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node in erased:
            continue
        if node.target is aten.rsqrt.default:
            match = _match_rms_norm(node)
            if match is not None:
                x, weight, eps, nodes = match
                _replace(gm, nodes, rms_norm_local, (x, weight, eps))
                erased.update(nodes)
                counts["rms_norm"] += 1
                counts["replaced_nodes"] += len(nodes)
        elif node.target is aten.silu.default:
            match = _match_swiglu(node)
            if match is not None:
                gate, up, nodes = match
                _replace(gm, nodes, swiglu_local, (gate, up))
                erased.update(nodes)
                counts["swiglu"] += 1
                counts["replaced_nodes"] += len(nodes)
    gm.graph.lint()
    gm.recompile()
    return counts


def keep_logits_sharded(gm: torch.fx.GraphModule, main_output_index: int,
                        produced: dict[str, str]) -> tuple[str, str] | None:
    """Drop the all-gather of vocab-sharded logits before the graph output (in place), so that
    the loss runs as the vocab-parallel cross-entropy on each tp rank's shard (kernels/
    cross_entropy.py; Shoeybi et al. 2019, sec. 3): two all-reduces of (N,) statistics in place
    of an all-gather of the (B, T, V) logits.

    Applies when output `main_output_index` of `gm` is `redistribute(logits, "R")` of logits
    whose planned placement (`produced`, by node name) is Shard of their last dim. Returns the
    (producer, "output") of the redistribution removed -- the plan's record the caller no longer
    inserts -- or None when nothing applies. The runtime then holds the local shard
    (..., V_local) of the logits as the stage's output.
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = tensor_args(out)
    if main_output_index >= len(flat):
        return None
    moved = flat[main_output_index]
    if not (moved.op == "call_function" and moved.target is redistribute
            and moved.args[1] == "R"):
        return None
    logits = moved.args[0]
    name = logits.meta.get("orig_name", logits.name)
    val = _val(logits)
    if val is None or produced.get(name) not in (f"S({val.ndim - 1})", "S(-1)"):
        return None
    moved.replace_all_uses_with(logits)
    gm.graph.erase_node(moved)
    gm.graph.lint()
    gm.recompile()
    return name, "output"
