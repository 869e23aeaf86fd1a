"""Cost model against the published formulas (docs/reference/FORMULAS.md, rows cited)."""

from __future__ import annotations

import math
import warnings
from decimal import ROUND_HALF_UP, Decimal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from autoplan.cost_model import activations, comm, compute, memory, symbolic
from autoplan.graph import NodeInfo
from autoplan.topology import preset


# --- ZeRO model states: FORMULAS.md "Model states memory" ------------------------------------

ZERO_CHECK_GB = {  # N_d: (stage 1, stage 2, stage 3) as printed, Psi = 7.5e9
    1: ("120", "120", "120"),
    4: ("52.5", "41.3", "30"),
    16: ("35.6", "21.6", "7.5"),
    64: ("31.4", "16.6", "1.88"),
    1024: ("30.1", "15.1", "0.12"),
}


@pytest.mark.parametrize("dp", sorted(ZERO_CHECK_GB))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_table_check_values(dp, stage):
    printed = Decimal(ZERO_CHECK_GB[dp][stage - 1])
    states = memory.model_state_bytes(7.5e9, stage, dp)
    gb = Decimal(repr(sum(states.values()) / 1e9))
    assert gb.quantize(printed, rounding=ROUND_HALF_UP) == printed  # 41.25 prints as 41.3
    assert sum(states.values()) == pytest.approx(
        symbolic.evaluate("model_state_bytes", Psi=7.5e9, d=dp, z=stage))


def test_zero_stage_rules_and_other_optimizers():
    psi, dp = 1e9, 8
    assert memory.model_state_bytes(psi, 0, dp) == {
        "params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi}
    assert sum(memory.model_state_bytes(psi, 0, dp).values()) == symbolic.evaluate(
        "zero_stage0_bytes", Psi=psi)
    fp32 = memory.model_state_bytes(psi, 2, dp, mixed_precision=False)
    assert fp32 == {"params": 4 * psi, "grads": 4 * psi / dp, "optimizer": 8 * psi / dp}
    sgd = memory.model_state_bytes(psi, 3, dp, mixed_precision=False, optimizer="sgd")
    assert sgd == {"params": 4 * psi / dp, "grads": 4 * psi / dp, "optimizer": 0.0}
    with pytest.raises(ValueError, match="zero_stage=4"):
        memory.model_state_bytes(psi, 4, dp)
    with pytest.raises(ValueError, match="'lion'"):
        memory.model_state_bytes(psi, 1, dp, optimizer="lion")


# --- Korthikanti et al. 2022, Table 2: FORMULAS.md "Activation memory per transformer layer" -

def test_korthikanti_rows():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    f = memory.activation_bytes_per_layer_closed_form
    assert f(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert f(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(s, b, h, a, t, sequence_parallel=True) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t)))
    assert f(s, b, h, a, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert f(s, b, h, a, t, sequence_parallel=True, recompute="selective") == pytest.approx(
        34 * sbh / t)
    assert f(s, b, h, a, t, recompute="full") == 2 * sbh
    values = dict(s=s, b=b, h=h, a=a, t=t)
    for name, kwargs in [("act_layer_tp", {}), ("act_layer_tp_sp", {"sequence_parallel": True}),
                         ("act_layer_tp_selective", {"recompute": "selective"}),
                         ("act_layer_tp_sp_selective",
                          {"sequence_parallel": True, "recompute": "selective"}),
                         ("act_layer_full_recompute", {"recompute": "full"})]:
        assert f(s, b, h, a, t, **kwargs) == pytest.approx(symbolic.evaluate(name, **values))
    assert f(s, b, h, a) == pytest.approx(symbolic.evaluate("act_layer", **values))
    with pytest.raises(ValueError, match="'some'"):
        f(s, b, h, a, recompute="some")


# --- activations derived from a captured GPT layer -------------------------------------------

class GPTBlock(nn.Module):
    """nanoGPT's Block written with functional ops: explicit softmax, dropout p > 0."""

    def __init__(self, h: int, a: int, s: int, p: float = 0.1):
        super().__init__()
        self.h, self.a, self.p = h, a, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.register_buffer("bias", torch.tril(torch.ones(s, s)).view(1, 1, s, s))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.h, dim=2)
        q, k, v = (u.view(B, T, self.a, C // self.a).transpose(1, 2) for u in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, a, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), self.p, self.training)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)         # (B, T, C)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)


def _capture(s, b, h, a, dtype, decompose=False):
    """torch.export on meta, training mode -> (NodeInfo per call_function node, producers)."""
    with torch.device("meta"):
        block = GPTBlock(h, a, s).to(dtype)
        x = torch.randn(b, s, h, dtype=dtype)
    block.train()
    exported = torch.export.export(block, (x,))
    if decompose:
        with warnings.catch_warnings():  # a torch-internal FutureWarning about LeafSpec
            warnings.simplefilter("ignore", FutureWarning)
            exported = exported.run_decompositions()
    gm = exported.module()

    def val(arg):
        return arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    nodes = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = tree_map(val, (node.args, node.kwargs))
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(node.meta["val"])[0] if isinstance(t, torch.Tensor)]
        nodes.append(NodeInfo(
            node.name, str(node.target), tuple(tuple(t.shape) for t in outs),
            tuple(str(t.dtype).removeprefix("torch.") for t in outs), nbytes(outs), nbytes(ins),
            counter.get_total_flops(), "", 0))
    return nodes, activations.node_producers(gm)


S, B, H, A = 128, 2, 256, 4


@pytest.mark.parametrize("decompose", [False, True], ids=["training-ir", "core-aten"])
@pytest.mark.parametrize("with_producers", [False, True])
def test_graph_activations_match_korthikanti(decompose, with_producers):
    """Within 5% of s*b*h*(34 + 5as/h) (Korthikanti et al. Table 2, fp16).

    The residual, +0.7% here, is what the paper leaves out and autograd does save: layer norm's
    fp32 mean and rstd (2 x 4 bytes per row, x2 norms: 16sb) and the causal-mask condition
    that masked_fill/where keeps (s^2 bools, shared by the batch and heads).
    """
    nodes, producers = _capture(S, B, H, A, torch.float16, decompose)
    producers = producers if with_producers else None
    sbh = S * B * H
    got = activations.activation_bytes_from_graph(nodes, producers=producers)
    explained = sbh * (34 + 5 * A * S / H) + 2 * 2 * S * B * 4 + S * S
    assert got == pytest.approx(sbh * (34 + 5 * A * S / H), rel=0.05)
    assert got == pytest.approx(explained, rel=1e-4)
    selective = activations.activation_bytes_from_graph(nodes, producers=producers,
                                                        policy="selective")
    assert selective == pytest.approx(34 * sbh, rel=0.05)
    full = activations.activation_bytes_from_graph(nodes, producers=producers, policy="full")
    assert full == 2 * sbh


def test_graph_activations_fp32_capture_at_bf16_width():
    nodes16, _ = _capture(S, B, H, A, torch.float16)
    nodes32, _ = _capture(S, B, H, A, torch.float32)
    at16 = activations.activation_bytes_from_graph(nodes16)
    assert activations.activation_bytes_from_graph(nodes32, dtype_bytes=2) == pytest.approx(at16)
    assert activations.activation_bytes_from_graph(nodes32) > 1.9 * at16


def test_graph_activations_tensor_parallel():
    """Megatron TP with t = 2 (shard factors on the column-parallel side, producers given):
    within 5% of s*b*h*(10 + 24/t + 5as/(ht)); the same residual as above, unsharded."""
    t = 2
    nodes, producers = _capture(S, B, H, A, torch.float16)
    names = [n.name for n in nodes]
    attention = names[names.index("linear"):names.index("view_3") + 1]
    sharded = {n: t for n in attention if n not in ("alias", "eq")}
    sharded.update({"linear_2": t, "gelu": t})  # fc output and GELU: S(-1); fc2 output: P
    got = activations.activation_bytes_from_graph(nodes, sharded, producers=producers)
    sbh = S * B * H
    assert got == pytest.approx(sbh * (10 + 24 / t + 5 * A * S / (H * t)), rel=0.05)
    assert got == pytest.approx(
        sbh * (10 + 24 / t + 5 * A * S / (H * t)) + 16 * S * B + S * S, rel=1e-4)


def test_graph_activation_errors():
    nodes, _ = _capture(S, B, H, A, torch.float16)
    with pytest.raises(ValueError, match="'partial'"):
        activations.activation_bytes_from_graph(nodes, policy="partial")
    with pytest.raises(ValueError, match="linear"):
        activations.activation_bytes_from_graph(nodes, {"linear": 0.5})


# --- pipeline in-flight microbatches and peak memory -----------------------------------------

def test_pipeline_in_flight():
    f = memory.pipeline_in_flight_microbatches
    assert f("gpipe", 4, 16) == 16
    assert [f("1f1b", 4, 16, stage=r) for r in range(4)] == [4, 3, 2, 1]
    assert f("1f1b", 8, 3) == 3
    for p, v in [(4, 2), (8, 3), (16, 4)]:
        assert f("interleaved-1f1b", p, 64, num_virtual_stages=v) == pytest.approx(
            p * symbolic.evaluate("interleaved_act_factor", p=p, v=v))
    assert f("interleaved-1f1b", 4, 16, num_virtual_stages=1) == 4
    with pytest.raises(ValueError, match="'zb'"):
        f("zb", 4, 8)
    with pytest.raises(ValueError, match="stage=4"):
        f("1f1b", 4, 8, stage=4)
    with pytest.raises(ValueError, match="interleaved"):
        f("1f1b", 4, 8, num_virtual_stages=2)


def test_first_stage_activations_under_1f1b():
    """FORMULAS.md: the first 1F1B stage holds p microbatches of L/p layers: s*b*h*L/t*(...)."""
    s, b, h, a, t, L, p = 2048, 1, 12288, 96, 8, 96, 8
    per_layer = memory.activation_bytes_per_layer_closed_form(s, b, h, a, t,
                                                              sequence_parallel=True)
    total = per_layer * (L // p) * memory.pipeline_in_flight_microbatches("1f1b", p, 64)
    assert total == pytest.approx(symbolic.evaluate("act_first_stage_1f1b", s=s, b=b, h=h, a=a,
                                                    t=t, L=L))


def test_peak_memory_is_the_larger_of_two_moments():
    """[Note: peak moments]: A = activations at their height, B = end of the backward."""
    states = memory.model_state_bytes(8e9, 3, 8)
    layer = 2 * 8e9 / 32
    peak = memory.peak_memory_bytes(model_states=states, activation_bytes=1e9,
                                    in_flight_microbatches=4, zero_stage=3, dp=8,
                                    layer_param_bytes=layer, output_bytes=0.5e9,
                                    comm_buffer_bytes=0.1e9)
    # A: gathered params of the current and the prefetched layer + the logits
    assert peak["temporaries"] == pytest.approx(2 * layer + 0.5e9)
    assert peak["activations"] == 4e9 and peak["grads"] == states["grads"]
    assert peak["peak"] == pytest.approx(sum(v for k, v in peak.items() if k != "peak"))
    # B: no activations left, the last unit's unsharded gradient on top of the sharded ones
    unit = 2 * 8e9  # one unit holding all of the rank's parameters (the runtime's)
    late = memory.peak_memory_bytes(model_states=states, activation_bytes=1e6,
                                    in_flight_microbatches=1, zero_stage=3, dp=8,
                                    gather_unit_bytes=unit, grads_at_activation_peak=False)
    assert late["activations"] == 0 and late["grads"] == pytest.approx(states["grads"] + unit)
    assert late["temporaries"] == pytest.approx(unit * (1 + 1 / 8))  # gathered + AG input
    early = memory.peak_memory_bytes(model_states=states, activation_bytes=30e9,
                                     in_flight_microbatches=1, zero_stage=3, dp=8,
                                     gather_unit_bytes=unit, grads_at_activation_peak=False)
    assert early["grads"] == 0 and early["activations"] == 30e9
    zero1 = memory.peak_memory_bytes(model_states=memory.model_state_bytes(8e9, 1, 8),
                                     activation_bytes=1e9, in_flight_microbatches=1,
                                     zero_stage=1, dp=8, layer_param_bytes=layer)
    assert zero1["temporaries"] == 0
    replicate = memory.peak_memory_bytes(model_states=memory.model_state_bytes(8e9, 0, 8),
                                         activation_bytes=1e9, in_flight_microbatches=1,
                                         zero_stage=0, dp=8, gather_unit_bytes=unit)
    assert replicate["temporaries"] == unit  # FSDP2's replicate gathers a full copy
    with pytest.raises(ValueError, match="optimizer"):
        memory.peak_memory_bytes(model_states={"params": 1, "grads": 1},
                                 activation_bytes=0, in_flight_microbatches=1)


# --- Narayanan et al. SC'21: FORMULAS.md "FLOPs and pipeline" --------------------------------

def test_gpt3_parameters_and_flops():
    gpt3 = dict(L=96, h=12288, V=51200, s=2048)
    # 12 * 96 * 12288^2 = 173.95e9; x (1 + 13/147456 + 53248/14155776) = x 1.003850
    assert symbolic.evaluate("num_params", **gpt3) == pytest.approx(174.6e9, rel=1e-3)
    # 72 * 1536 * 2048 * 96 * 12288^2 = 3.2829e18; x (1 + 2048/73728 + 51200/14155776)
    # = x 1.031395 -> 3.386e18 per iteration at B = 1536
    flops = symbolic.evaluate("model_flops", B=1536, **gpt3)
    assert flops == pytest.approx(3.386e18, rel=1e-3)
    hardware = symbolic.evaluate("hardware_flops_full_recompute", B=1536, **gpt3)
    assert hardware / flops == pytest.approx(4 / 3, rel=0.01)
    assert symbolic.evaluate("bubble_fraction", p=8, m=64) == 7 / 64
    assert symbolic.evaluate("bubble_fraction_interleaved", p=8, m=64, v=2) == 7 / 128


def test_symbolic_api():
    assert "Psi" in symbolic.latex("zero_stage3_bytes")
    with pytest.raises(ValueError, match="needs values for \\['h'"):
        symbolic.evaluate("num_params", L=1, V=1, s=1)
    with pytest.raises(ValueError, match="unknown formula 'nope'"):
        symbolic.evaluate("nope")
    with pytest.raises(ValueError, match="unknown symbol"):
        symbolic.evaluate("bubble_fraction", p=2, m=2, q=1)
    assert set(symbolic.SOURCES) == set(symbolic.FORMULAS)


# --- compute roofline ------------------------------------------------------------------------

def _node(target, shape, flops, in_bytes, out_bytes, dtype="bfloat16"):
    return NodeInfo("n", target, (shape,), (dtype,), out_bytes, in_bytes, flops, "", None)


def test_roofline_matmul_and_elementwise():
    dev = preset("dgx-h100").device
    d = 4096
    mm = _node("aten.mm.default", (d, d), 2 * d**3, 2 * d * d * 2, d * d * 2)
    eff = dev.matmul_efficiency * d / (d + compute.MATMUL_HALF_DIM)
    assert compute.op_time_s(mm, dev, "bfloat16") == pytest.approx(
        2 * d**3 / (989e12 * eff) + dev.launch_latency_s)
    half = compute.op_time_s(mm, dev, "bfloat16", shard_factor=2)
    eff2 = dev.matmul_efficiency * (d / 2) / (d / 2 + compute.MATMUL_HALF_DIM)
    assert half == pytest.approx(d**3 / (989e12 * eff2) + dev.launch_latency_s)
    assert compute.backward_time_s(mm, dev, "bfloat16") == pytest.approx(
        2 * compute.op_time_s(mm, dev, "bfloat16"))
    gelu = _node("aten.gelu.default", (d, d), 0, d * d * 4, d * d * 4, dtype="float32")
    # captured in fp32, computed in bf16: bytes halve
    assert compute.op_time_s(gelu, dev, "bfloat16") == pytest.approx(
        d * d * 4 / 3.35e12 + dev.launch_latency_s)
    assert compute.backward_time_s(gelu, dev, "bfloat16") == pytest.approx(
        1.5 * d * d * 4 / 3.35e12 + dev.launch_latency_s)
    view = _node("aten.view.default", (d, d), 0, d * d * 2, d * d * 2)
    assert compute.op_time_s(view, dev, "bfloat16") == 0.0
    assert compute.graph_forward_time_s([mm, gelu, view], dev, "bfloat16") == pytest.approx(
        compute.op_time_s(mm, dev, "bfloat16") + compute.op_time_s(gelu, dev, "bfloat16"))
    with pytest.raises(ValueError, match="'int4'"):
        compute.op_time_s(mm, dev, "int4")
    with pytest.raises(ValueError, match="flops=0"):
        compute.op_time_s(_node("aten.mm.default", (d, d), 0, 1, 1), dev, "bfloat16")


def test_matmul_efficiency_curve():
    dev = preset("dgx-h100").device
    effs = [compute.matmul_efficiency(d, dev) for d in (16, 128, 1024, 8192, 1e9)]
    assert effs == sorted(effs)
    assert effs[1] == pytest.approx(dev.matmul_efficiency / 2)
    assert effs[-1] == pytest.approx(dev.matmul_efficiency)
    # a skinny matmul (m = 8 tokens) is slower per FLOP than a square one
    big = _node("aten.mm.default", (4096, 4096), 2 * 4096**3, 2 * 4096**2 * 2, 4096**2 * 2)
    skinny = _node("aten.mm.default", (8, 4096), 2 * 8 * 4096**2, (8 + 4096) * 4096 * 2,
                   8 * 4096 * 2)
    per_flop = [compute.op_time_s(x, dev, "bfloat16") / x.flops for x in (big, skinny)]
    assert per_flop[1] > 10 * per_flop[0]


def test_captured_layer_times_are_positive_and_matmul_dominated():
    nodes, _ = _capture(1024, 8, 1024, 16, torch.bfloat16)
    dev = preset("dgx-h100").device
    fwd = compute.graph_forward_time_s(nodes, dev, "bfloat16")
    bwd = compute.graph_backward_time_s(nodes, dev, "bfloat16")
    flops = sum(n.flops for n in nodes)
    assert flops / fwd < 989e12 * dev.matmul_efficiency
    assert 1.5 * fwd < bwd < 2.5 * fwd


def test_measured_link_entries_and_transcendental_ops():
    """[Note: measured collectives] and the roofline's elementwise term ([Note: roofline])."""
    import dataclasses

    topo = preset("local-cpu", devices_per_node=4)
    link = dataclasses.replace(topo.intra_node, collectives={
        "all_gather": {2: {1: [1e-4, 5e8], 2: [3e-4, 2e8]}}})
    topo = dataclasses.replace(topo, intra_node=link)
    n = 2**20
    # 2 groups of 2 on 4 ranks run at once: the (p=2, g=2) entry
    assert comm.collective_time_s("all_gather", n, 2, topo) == pytest.approx(3e-4 + n / 2 / 2e8)
    assert comm.collective_time_s("all_gather", n, 2, topo, concurrent_groups=1) == \
        pytest.approx(1e-4 + n / 2 / 5e8)
    assert comm.collective_time_s("all_reduce", n, 2, topo) == pytest.approx(
        2 * link.latency_s + n / link.bw_bytes_per_s)  # no entry: the link's own figures
    node = NodeInfo("t", "aten.tanh.default", ((1024, 1024),), ("float32",), 4 * 2**20,
                    4 * 2**20, 0, "", 0)
    dev = topo.device
    slow = dataclasses.replace(dev, elementwise_s_per_elem={"tanh": 3e-9})
    assert compute.op_time_s(node, dev, "float32") == pytest.approx(
        8 * 2**20 / dev.mem_bw_bytes_per_s + dev.launch_latency_s)
    assert compute.op_time_s(node, slow, "float32") == pytest.approx(
        2**20 * 3e-9 + dev.launch_latency_s)
    # tanh's gradient reuses its output (no tanh again); pow's evaluates pow again
    assert compute.backward_time_s(node, slow, "float32") == pytest.approx(
        compute.backward_time_s(node, dev, "float32"))
    power = dataclasses.replace(node, target="aten.pow.Tensor_Scalar")
    slow_pow = dataclasses.replace(dev, elementwise_s_per_elem={"pow": 3e-9})
    assert compute.backward_time_s(power, slow_pow, "float32") == pytest.approx(
        2**20 * 3e-9 + dev.launch_latency_s)
    # a node rescaled to a quarter of the tokens (solver/costs.py scales bytes, not shapes)
    # costs a quarter of the elements
    quarter = dataclasses.replace(node, in_bytes=2**20, out_bytes=2**20)
    assert compute.op_time_s(quarter, slow, "float32") == pytest.approx(
        2**18 * 3e-9 + dev.launch_latency_s)


@pytest.mark.parametrize("frozen, rel", [("none", 0.05), ("lora-like", 0.05),
                                         ("all-but-head", 0.0)])
def test_saved_tensors_are_what_autograd_keeps(frozen, rel):
    """[Note: saved tensors], "only what a gradient needs": a 2-layer llama-tiny run under
    saved_tensors_hooks keeps (unique storages, parameters and buffers aside) what the rules
    price with `grad_carriers` -- rotary tables and frozen weights' inputs kept by nothing,
    an operand kept once -- fully trained, with only q_proj and down_proj trained (a LoRA's
    shape), and with only the head trained (its input, nothing else). The rules without
    `grads` price every value as requiring a gradient: 29%, 66% and 52x over."""
    import copy
    import math

    import _jobs
    from autoplan.capture import capture
    from autoplan.passes.device import materialize

    model = _jobs.preset("llama-tiny", num_hidden_layers=2)()
    for name, p in model.named_parameters():
        if (frozen == "lora-like" and not name.endswith(("q_proj.weight", "down_proj.weight"))) \
                or (frozen == "all-but-head" and "lm_head" not in name):
            p.requires_grad_(False)
    x = torch.zeros(2, 16, dtype=torch.long)
    graph = capture(model, (x,))
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    materialize(gm, model, "cpu")
    held = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gm(x)
    infos = [graph.nodes[n.name] for n in gm.graph.nodes if n.name in graph.nodes]
    numel = {n: math.prod(i.shapes[0]) for n, i in graph.nodes.items() if i.shapes}
    priced = activations.activation_bytes_from_graph(
        infos, producers=activations.node_producers(graph.gm), value_numel=numel,
        grads=activations.grad_carriers(graph.gm, graph.params))
    assert priced == pytest.approx(sum(kept.values()), rel=rel, abs=0)
