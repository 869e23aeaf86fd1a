"""Link levels: every pipeline hop and every collective group is priced at the link it crosses,
given where the mesh's ranks sit on the nodes (cost_model/comm.py [Note: group layout],
[Note: pipeline hops]). Issue 26: on 2 nodes x 8 with a slow inter-node link, pp 4 x dp 4 x tp 1
priced its stage 1 -> 2 hop, which crosses the nodes, as NVLink, because stages of 4 ranks are
smaller than a node."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.cost_model import comm
from autoplan.cost_model.config import Config
from autoplan.cost_model.placement_totals import Solution
from autoplan.cost_model.step_time import pipeline_time_s
from autoplan.topology import LinkSpec, load_topology, preset, save_topology

LAYERS = 12
BOUNDARY_BYTES = 1e6  # one microbatch's residual stream on a tp rank
LAYER_S = 1e-3  # compute of all layers, one microbatch


@pytest.fixture
def cluster(tmp_path):
    """2 nodes x 8 H100 with 1e8 B/s between nodes, from a YAML as a user writes it."""
    base = preset("dgx-h100", num_nodes=2)
    path = tmp_path / "cluster.yaml"
    save_topology(dataclasses.replace(base, inter_node=LinkSpec("ethernet", 1e8, 1e-5)), path)
    return load_topology(path)


def _message_s(nbytes, link, pairs=1):
    """One p2p message on `link` with `pairs` sharing it: latency + nbytes / (bw / pairs)."""
    return nbytes / (link.bw_bytes_per_s / pairs) + link.latency_s


def _pipeline_s(cluster, pp, dp, m=8, v=1):
    cfg = Config(pp=pp, dp=dp, tp=1, zero_stage=0, num_microbatches=m, microbatch_size=1,
                 schedule="1f1b" if v == 1 else "interleaved-1f1b", num_virtual_stages=v)
    sol = Solution(choice={}, compute_s={"layer": LAYER_S}, boundary_bytes=BOUNDARY_BYTES)
    return pipeline_time_s(cfg, sol, cluster, total_layers=LAYERS, boundary_bytes=BOUNDARY_BYTES)


def test_pp4_dp4_prices_its_cross_node_hop_at_the_inter_node_link(cluster):
    """Stages 0, 1 on node 0 and 2, 3 on node 1: the 1 -> 2 hop's 4 pairs share node 0's NICs,
    and the schedule runs at that hop's pace (2 messages per microbatch, m + pp - 1 slots)."""
    pp, dp, m = 4, 4, 8
    inter = _message_s(BOUNDARY_BYTES, cluster.inter_node, pairs=dp)
    slot = LAYER_S / pp + 2 * inter
    assert _pipeline_s(cluster, pp, dp, m) == pytest.approx((m + pp - 1) * slot)
    # the same mesh inside one node of 16 pays NVLink: the step grows by the inter-node time
    one_node = dataclasses.replace(cluster, num_nodes=1, devices_per_node=16)
    intra = _message_s(BOUNDARY_BYTES, cluster.intra_node)
    grown = _pipeline_s(cluster, pp, dp, m) - _pipeline_s(one_node, pp, dp, m)
    assert grown == pytest.approx((m + pp - 1) * 2 * (inter - intra))


def test_pp2_dp8_crosses_with_every_rank_of_the_node(cluster):
    """Stages fill whole nodes: one rail per pair (bw / 8), as before the fix."""
    pp, dp, m = 2, 8, 8
    inter = _message_s(BOUNDARY_BYTES, cluster.inter_node, pairs=cluster.devices_per_node)
    assert _pipeline_s(cluster, pp, dp, m) == pytest.approx(
        (m + pp - 1) * (LAYER_S / pp + 2 * inter))
    assert comm.pipeline_hop_time_s(BOUNDARY_BYTES, cluster, pp=pp, stage_ranks=dp) == \
        pytest.approx(comm.p2p_time_s(BOUNDARY_BYTES, cluster, crosses_nodes=True))


def test_hops_inside_a_node_are_priced_intra_node(cluster):
    """On 8-device nodes with stages of 4 ranks, hops 0 -> 1 and 2 -> 3 stay in a node, 1 -> 2
    and the interleaved wrap-around 3 -> 0 cross; a pipeline whose stages all sit in node 0
    pays NVLink, wrap-around included."""
    crosses = {(a, b): comm.hop_crosses_nodes(a, b, 4, cluster)
               for a, b in ((0, 1), (1, 2), (2, 3), (3, 0))}
    assert crosses == {(0, 1): False, (1, 2): True, (2, 3): False, (3, 0): True}
    assert comm.hop_crosses_nodes(0, 1, 8, cluster)  # a stage per node
    assert not comm.hop_crosses_nodes(0, 3, 2, cluster)  # ranks 0..1 -> 6..7
    assert comm.hop_crosses_nodes(0, 1, 6, cluster)  # ranks 0..5 -> 6..11: two pairs cross
    intra = _message_s(BOUNDARY_BYTES, cluster.intra_node)
    for pp, stage_ranks, v in ((2, 4, 1), (2, 4, 2), (4, 2, 2)):
        assert comm.pipeline_hop_time_s(BOUNDARY_BYTES, cluster, pp=pp, stage_ranks=stage_ranks,
                                        num_virtual_stages=v) == pytest.approx(intra)
    inter = _message_s(BOUNDARY_BYTES, cluster.inter_node, pairs=4)
    assert comm.pipeline_hop_time_s(BOUNDARY_BYTES, cluster, pp=4, stage_ranks=4,
                                    num_virtual_stages=2) == pytest.approx(inter)
    # send_recv on the pp group (stride: ranks per stage) follows the same rule
    assert comm.collective_time_s("send_recv", BOUNDARY_BYTES, 4, cluster, stride=4,
                                  concurrent_groups=4) == pytest.approx(inter)


def test_a_group_smaller_than_a_node_that_straddles_nodes_is_priced_across_them(cluster):
    """pp 1 x dp 4 x tp 4 on 8-device nodes: a dp group of 4 ranks (stride 4: 0, 4, 8, 12)
    has 2 members on each node, so its all-reduce is hierarchical over the inter-node link;
    a dp group of 4 with stride 2 (dp 4 x tp 2) stays on NVLink. A group that would straddle a
    node boundary unevenly (3 ranks of stride 4: 0, 4, 8 on nodes 0, 0, 1) is an error."""
    n = 1e8
    intra, inter = cluster.intra_node, cluster.inter_node
    assert comm.group_layout(4, 4, cluster) == (2, 2)
    k, num_nodes = 2, 2
    rail = inter.bw_bytes_per_s / cluster.devices_per_node
    hierarchical = (max(2 * n * (k - 1) / k / intra.bw_bytes_per_s,
                        2 * (n / k) * (num_nodes - 1) / num_nodes / rail)
                    + 2 * (k - 1) * intra.latency_s + 2 * (num_nodes - 1) * inter.latency_s)
    assert comm.collective_time_s("all_reduce", n, 4, cluster, stride=4) == \
        pytest.approx(hierarchical)
    flat_intra = 2 * 3 / 4 * n / intra.bw_bytes_per_s + 6 * intra.latency_s
    assert comm.collective_time_s("all_reduce", n, 4, cluster, stride=2) == \
        pytest.approx(flat_intra)
    with pytest.raises(ValueError, match="straddles node boundaries unevenly"):
        comm.collective_time_s("all_reduce", n, 3, cluster, stride=4)


def test_planned_pp4_dp4_reports_its_transfers_at_the_inter_node_link(cluster):
    """As a user plans it (`autoplan plan --pp 4 --dp 4 --tp 1` on the YAML cluster): the
    plan's pipeline transfers are 2 v messages of the crossing hop, a GPT-2 microbatch's
    residual stream (b x s x 768 bfloat16) over bw / 4 per pair."""
    from autoplan.capture import capture_preset
    from autoplan.solver import plan
    from autoplan.spec import TrainingSpec

    seq_len = 32
    graph = capture_preset("gpt2", batch=1, seq_len=seq_len, num_layers=1)
    p = plan(graph, cluster, TrainingSpec(global_batch=32, seq_len=seq_len, dtype="bfloat16"),
             pp=4, dp=4, tp=1)
    boundary = p.microbatch_size * seq_len * 768 * 2
    inter = _message_s(boundary, cluster.inter_node, pairs=4)
    assert p.prediction.p2p_s == pytest.approx(2 * p.num_virtual_stages * inter)
    # the report's mesh table says the same of the pp axis
    from autoplan.report.facts import mesh_axes

    pp_axis = next(a for a in mesh_axes(p, cluster) if a.name == "pp")
    assert pp_axis.level == "inter-node" and "across nodes over ethernet" in pp_axis.text


def test_an_ep_group_that_straddles_nodes_is_not_offered():
    """A 6-expert MoE on 3 nodes x 8, dp 24: ep 3 (and 6) would put an ep group on two nodes
    unevenly (ranks 6, 7, 8): a given ep 3 is a named error, and the search of ep leaves those
    degrees out instead of failing inside the cost model."""
    import torch

    import _moe
    from autoplan.capture import capture
    from autoplan.solver import plan
    from autoplan.solver.configurations import InvalidConfig
    from autoplan.spec import TrainingSpec

    graph = capture(_moe.factory("mixtral", num_local_experts=6)().to("meta"),
                    (torch.zeros(1, 64, dtype=torch.long, device="meta"),), total_layers=8)
    spec, topology = TrainingSpec(global_batch=48, seq_len=64), preset("dgx-h100", 3)
    with pytest.raises(InvalidConfig, match="straddles node boundaries unevenly") as e:
        plan(graph, topology, spec, dp=24, tp=1, zero_stage=0, ep=3)
    assert e.type is InvalidConfig and str(e.value).startswith("ep 3: ")
    assert plan(graph, topology, spec, dp=24, tp=1, zero_stage=0).mesh.ep in (1, 2)
