"""Communication cost model: the collective formulas of FORMULAS.md ("Collective costs") for
flat and hierarchical groups, stragglers, point-to-point, and DTensor's redistributions with
their backward duals (cost_model/comm.py)."""

from __future__ import annotations

import pytest

from autoplan.cost_model import comm, symbolic
from autoplan.topology import preset


# --- collectives: FORMULAS.md "Collective costs" ---------------------------------------------

def _flat(kind, n, p, link):
    factor = {"all_reduce": 2 * (p - 1) / p, "send_recv": 1.0}.get(kind, (p - 1) / p)
    steps = {"all_reduce": 2 * (p - 1), "send_recv": 1}.get(kind, p - 1)
    return n * factor / link.bw_bytes_per_s + steps * link.latency_s


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_flat_ring_inside_a_node(kind):
    topo = preset("dgx-h100", num_nodes=4)
    n = 1e9
    assert comm.collective_time_s(kind, n, 8, topo) == pytest.approx(
        _flat(kind, n, 8, topo.intra_node))
    assert comm.collective_time_s(kind, n, 4, topo, stride=2) == pytest.approx(
        _flat(kind, n, 4, topo.intra_node))
    link = topo.intra_node
    assert comm.collective_time_s(kind, n, 8, topo) == pytest.approx(symbolic.evaluate(
        f"{kind}_time", n=n, g=8, alpha=link.latency_s, beta=1 / link.bw_bytes_per_s))
    assert comm.collective_time_s(kind, n, 1, topo) == 0.0


def test_one_member_per_node_uses_inter_node_link_shared_by_rails():
    topo = preset("dgx-a100", num_nodes=16)
    n = 1e9
    rail = topo.inter_node.bw_bytes_per_s / topo.devices_per_node  # 24 GB/s, one HDR NIC
    got = comm.collective_time_s("all_reduce", n, 16, topo, stride=8)
    assert got == pytest.approx(2 * 15 / 16 * n / rail + 30 * topo.inter_node.latency_s)
    alone = comm.collective_time_s("all_reduce", n, 16, topo, stride=8, concurrent_groups=1)
    assert alone == pytest.approx(2 * 15 / 16 * n / topo.inter_node.bw_bytes_per_s
                                  + 30 * topo.inter_node.latency_s)
    assert comm.group_layout(16, 8, topo) == (1, 16)
    assert comm.group_layout(8, 1, topo) == (8, 1)
    assert comm.group_layout(32, 2, topo) == (4, 8)


def test_hierarchical_group_and_its_levels():
    topo = preset("dgx-a100", num_nodes=16)
    n, k, N = 4e9, 8, 16
    intra, inter = topo.intra_node, topo.inter_node
    got = comm.collective_time_s("all_reduce", n, k * N, topo)
    rail = inter.bw_bytes_per_s / topo.devices_per_node
    formula = (max(2 * n * (k - 1) / k / intra.bw_bytes_per_s,
                   2 * (n / k) * (N - 1) / N / rail)
               + 2 * (k - 1) * intra.latency_s + 2 * (N - 1) * inter.latency_s)
    assert got == pytest.approx(formula)
    intra_level = comm.collective_time_s("all_reduce", n, k, topo)
    inter_level = comm.collective_time_s("all_reduce", n / k, N, topo, stride=k)
    assert got >= intra_level and got >= inter_level
    # Consistency with the measured multi-node busbw of FORMULAS.md (~192 GB/s, A100): the
    # implied bus bandwidth of the whole group is within 10% of it.
    busbw = 2 * (k * N - 1) / (k * N) * n / got
    assert busbw == pytest.approx(inter.bw_bytes_per_s, rel=0.10)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        spanning = comm.collective_time_s(kind, n, k * N, topo)
        assert spanning >= comm.collective_time_s(kind, n, k, topo)


def test_stragglers_add_the_skew_to_every_collective_but_not_to_p2p():
    """[Note: stragglers]: with n busy devices each blocking collective waits skew(n) more."""
    import dataclasses

    base = preset("dgx-h100", num_nodes=2)
    skewed = dataclasses.replace(base, device=dataclasses.replace(
        base.device, sync_skew_s={2: 1e-4, 8: 3e-3}))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for size, stride in ((8, 1), (16, 1), (2, 8)):  # flat, hierarchical, inter-node
            plain = comm.collective_time_s(kind, 1e6, size, base, stride=stride)
            assert comm.collective_time_s(kind, 1e6, size, skewed, stride=stride) == (
                pytest.approx(plain + 3e-3))  # all 8 devices of a node busy under SPMD
    assert comm.collective_time_s("all_reduce", 1e6, 1, skewed) == 0.0
    assert comm.collective_time_s("send_recv", 1e6, 2, skewed) == pytest.approx(
        comm.collective_time_s("send_recv", 1e6, 2, base))
    assert comm.redistribute_time_s("S(0)", "R", 1e6, 8, skewed)[1] == pytest.approx(
        comm.redistribute_time_s("S(0)", "R", 1e6, 8, base)[1] + 3e-3)


def test_collective_errors():
    topo = preset("dgx-h100", num_nodes=2)
    with pytest.raises(ValueError, match="'scatter'.*all_reduce"):
        comm.collective_time_s("scatter", 1.0, 8, topo)
    with pytest.raises(ValueError, match="nbytes=-1"):
        comm.collective_time_s("all_reduce", -1, 8, topo)
    with pytest.raises(ValueError, match="group_size=0"):
        comm.collective_time_s("all_reduce", 1.0, 0, topo)
    with pytest.raises(ValueError, match="straddles"):
        comm.collective_time_s("all_reduce", 1.0, 3, topo)
    with pytest.raises(ValueError, match="more than the 16"):
        comm.collective_time_s("all_reduce", 1.0, 8, topo, stride=4)


def test_p2p():
    topo = preset("dgx-h100", num_nodes=2)
    n = 1e8
    assert comm.p2p_time_s(n, topo, crosses_nodes=False) == pytest.approx(
        n / topo.intra_node.bw_bytes_per_s + topo.intra_node.latency_s)
    assert comm.p2p_time_s(n, topo, crosses_nodes=True) == pytest.approx(
        n / 46e9 + topo.inter_node.latency_s)
    assert comm.collective_time_s("send_recv", n, 2, topo, stride=8) == pytest.approx(
        comm.p2p_time_s(n, topo, crosses_nodes=True))


# --- redistribution (DTensor semantics) and its backward -------------------------------------

def test_redistribute_table():
    topo = preset("dgx-h100")
    n, p = 1e8, 8
    time = comm.collective_time_s
    assert comm.redistribute_time_s("R", "R", n, p, topo) == ("none", 0.0)
    assert comm.redistribute_time_s("R", "S(0)", n, p, topo) == ("slice", 0.0)
    assert comm.redistribute_time_s("R", "P", n, p, topo) == ("none", 0.0)
    assert comm.redistribute_time_s("P", "P", n, p, topo) == ("none", 0.0)
    assert comm.redistribute_time_s("S(1)", "R", n, p, topo) == (
        "all_gather", time("all_gather", n, p, topo))
    assert comm.redistribute_time_s("P", "R", n, p, topo) == (
        "all_reduce", time("all_reduce", n, p, topo))
    assert comm.redistribute_time_s("P", "S(0)", n, p, topo) == (
        "reduce_scatter", time("reduce_scatter", n, p, topo))
    assert comm.redistribute_time_s("S(0)", "S(1)", n, p, topo) == (
        "all_to_all", time("all_to_all", n / p, p, topo))
    # CPU ranks: gloo has no all-to-all; DTensor all-gathers the whole tensor instead
    cpu = preset("local-cpu", devices_per_node=p)
    assert not cpu.device.all_to_all and topo.device.all_to_all
    assert comm.redistribute_time_s("S(0)", "S(1)", n, p, cpu) == (
        "all_gather", time("all_gather", n, p, cpu) + cpu.device.dtensor_redistribute_s)
    assert comm.redistribute_time_s("P", "R", n, 1, topo) == ("none", 0.0)
    with pytest.raises(ValueError, match="S\\(0\\) -> P"):
        comm.redistribute_time_s("S(0)", "P", n, p, topo)
    with pytest.raises(ValueError, match="'Q'"):
        comm.redistribute_time_s("Q", "R", n, p, topo)


def test_backward_redistribution_duals():
    f = comm.backward_redistribution
    assert f("S(0)", "R") == ("R", "S(0)")                     # slice
    assert f("S(0)", "R", grad_placement="P") == ("P", "S(0)")  # reduce-scatter (Megatron-SP)
    assert f("R", "S(1)") == ("S(1)", "R")                     # all-gather
    assert f("P", "R") == ("R", "R")                           # g: identity backward
    assert f("P", "S(0)") == ("S(0)", "R")                     # all-gather
    assert f("R", "R", grad_placement="P") == ("P", "R")       # f: all-reduce backward
    assert f("S(0)", "S(1)") == ("S(1)", "S(0)")               # all-to-all


def test_megatron_layer_tp_traffic_matches_formula():
    """A Megatron layer on the tp axis: per block (attention, MLP) the replicated input enters a
    column-parallel matmul (R -> R forward, gradient P: f) and the row-parallel output is
    all-reduced (P -> R: g). Forward + backward all-reduce bytes = 4 b s h e (FORMULAS.md)."""
    topo = preset("dgx-h100")
    b, s, h, e, t = 4, 2048, 8192, 2, 8
    nbytes = b * s * h * e
    collectives = []
    for _block in ("attention", "mlp"):
        for src, dst, grad in [("R", "R", "P"), ("P", "R", None)]:
            collectives.append(comm.redistribute_time_s(src, dst, nbytes, t, topo)[0])
            back = comm.backward_redistribution(src, dst, grad_placement=grad)
            collectives.append(comm.redistribute_time_s(*back, nbytes, t, topo)[0])
    assert collectives.count("all_reduce") == 4
    assert collectives.count("all_reduce") * nbytes == symbolic.evaluate(
        "tp_allreduce_bytes_per_layer", b=b, s=s, h=h, e=e)
