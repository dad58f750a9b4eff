"""Link and Hardware: validation, presets, placement of groups, and measured_here."""

import math

import pytest

from parlib.cost import Hardware, Link, collective_time, fit_alpha_beta


def test_link_and_cluster_validate():
    assert Link(1e-6, 2e9).beta == 5e-10
    with pytest.raises(ValueError, match="bandwidth"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match="alpha"):
        Link(-1.0, 1e9)
    fast, slow = Link(1e-6, 1e11), Link(1e-5, 1e10)
    with pytest.raises(ValueError, match="whole number of nodes"):
        Hardware(12, 8, 80e9, 1e15, fast, slow)
    with pytest.raises(ValueError, match="n_devices must be a positive integer"):
        Hardware(0, 8, 80e9, 1e15, fast, slow)
    with pytest.raises(ValueError, match="compute_efficiency"):
        Hardware(8, 8, 80e9, 1e15, fast, slow, compute_efficiency=1.5)
    with pytest.raises(ValueError, match="intra_node must be a Link"):
        Hardware(8, 8, 80e9, 1e15, (1e-6, 1e11), slow)


def test_presets_carry_the_datasheet_figures():
    a100, h100, h200 = Hardware.dgx_a100(64), Hardware.dgx_h100(64), Hardware.dgx_h200(64)
    assert (a100.peak_flops, a100.memory_bytes, a100.devices_per_node) == (312e12, 80e9, 8)
    assert (a100.intra_node.bandwidth, a100.inter_node.bandwidth) == (300e9, 25e9)
    assert (h100.peak_flops, h100.memory_bytes) == (989.5e12, 80e9)
    assert (h100.intra_node.bandwidth, h100.inter_node.bandwidth) == (450e9, 50e9)
    assert h200.memory_bytes == 141e9 and h200.peak_flops == h100.peak_flops
    assert a100.n_nodes == 8 and Hardware.dgx_h100(4).n_nodes == 1
    assert Hardware.dgx_h100(16, memory_bytes=40e9).memory_bytes == 40e9


def test_groups_of_adjacent_ranks_stay_in_a_node_when_they_fit():
    c = Hardware.dgx_h100(64)
    assert c.link_for(1) == c.link_for(8) == c.achievable_intra_node
    assert c.link_for(16) is c.inter_node
    assert c.link_for(3) is c.inter_node  # blocks of 3 straddle nodes of 8
    assert c.in_one_node(4) and not c.in_one_node(64)


def test_measured_here_recovers_the_link_from_an_all_reduce_fit():
    alpha, beta, n = 150e-6, 2e-9, 4  # a laptop's loopback: 150 us, 0.5 GB/s
    sizes = [2**k for k in range(10, 23)]
    seconds = [collective_time("all_reduce", x, n, alpha, beta) for x in sizes]
    here = Hardware.measured_here(4, allreduce_fit=fit_alpha_beta(sizes, seconds), fit_ranks=n,
                                 flops_per_second=2e10)
    assert here.intra_node.alpha == pytest.approx(alpha, rel=1e-6)
    assert here.intra_node.bandwidth == pytest.approx(1 / beta, rel=1e-6)
    assert here.inter_node == here.intra_node and here.devices_per_node == 4
    assert here.peak_flops == 2e10 and math.isinf(here.memory_bytes)
    with pytest.raises(ValueError, match="slope"):
        Hardware.measured_here(4, allreduce_fit=(1e-4, -1e-9), fit_ranks=4, flops_per_second=1e9)


def test_slowed_link_adds_times():
    from parlib.cost import Link

    link = Link(alpha=1e-5, bandwidth=1e9).slowed_by(4e-5, 1e-9)
    assert link.alpha == pytest.approx(5e-5)
    assert link.beta == pytest.approx(2e-9)  # 1 ns/B + 1 ns/B: half the bandwidth
    with pytest.raises(ValueError, match=">= 0"):
        Link(1e-5, 1e9).slowed_by(-1.0, 0.0)


def test_nvlink_runs_at_its_generations_measured_fraction():
    # the ML Engineering book's all-reduce bus bandwidth at 16 GiB on one 8-GPU node:
    # A100 234.89 of 300 GB/s; NVLink 4 (H200, with NCCL's ring) 367.61 of 450
    a100, h100, h200 = Hardware.dgx_a100(8), Hardware.dgx_h100(8), Hardware.dgx_h200(8)
    assert a100.link_for(8).alpha == 5e-6
    assert a100.link_for(8).bandwidth == pytest.approx(234.89e9)
    assert h100.link_for(8).bandwidth == h200.link_for(8).bandwidth == pytest.approx(367.61e9)
    assert a100.intra_node.bandwidth == 300e9  # the datasheet figure stays the preset's
    assert a100.link_for(16) is a100.inter_node  # InfiniBand: the datasheet's rate
    assert a100.at_peak.link_for(8) is a100.intra_node
    # a hand-made Hardware has efficiency 1: its links are its own
    own = Hardware(8, 8, 80e9, 1e15, Link(1e-6, 1e11), Link(1e-5, 1e10))
    assert own.link_for(8) is own.intra_node
    with pytest.raises(ValueError, match="intra_node_efficiency must be in"):
        own.with_(intra_node_efficiency=1.5)
    # a tensor-parallel all-reduce of 100 MB on 8 A100s: 14 alphas + 2 x 7/8 x 1e8 B at
    # 234.89 GB/s = 70 us + 745.0 us
    link = a100.link_for(8)
    assert collective_time("all_reduce", 1e8, 8, link.alpha, link.beta) == pytest.approx(
        70e-6 + 1.75e8 / 234.89e9)


def test_jean_zay_link_reproduces_bigscience_all_reduce():
    # BigScience's all_reduce_bench on 4 Jean Zay A100 nodes: 4 GB of fp32 over 32 ranks
    # in 1.5312 s (busbw 40.49 Gb/s)
    jz = Hardware.jean_zay_a100(384)
    assert jz.link_for(32) is jz.inter_node  # 5.06 / 8 GB/s: a GPU's share of its node's
    assert jz.inter_node.bandwidth == pytest.approx(5.061e9 / 8, rel=1e-3)
    ring = jz.ring_link(32, 32)  # 8 ranks a node share it
    assert ring.bandwidth == pytest.approx(5.061e9, rel=1e-3)
    assert collective_time("all_reduce", 4e9, 32, ring.alpha, ring.beta) == pytest.approx(
        1.5312)
    assert jz.n_devices == 384 and jz.generation == "A100"


def test_ring_collectives_share_a_nodes_links():
    a100 = Hardware.dgx_a100(64)  # NVLink 234.89 GB/s achievable, 25 GB/s per GPU's NIC
    # inside a node: NVLink
    assert a100.ring_link(8, 8) == a100.link_for(8)
    assert a100.ring_crossing_share(8, 8) == 0
    # one rank a node (a data-parallel group beside t = 8): that rank's NIC, all its bytes
    assert a100.ring_link(64, 8) is a100.inter_node and a100.ring_crossing_share(64, 8) == 1
    # two ranks a node (beside t = 4): 1/2 of each rank's bytes cross, over 2 NICs: 50 GB/s
    assert a100.ring_link(64, 16).bandwidth == pytest.approx(50e9)
    assert a100.ring_crossing_share(64, 16) == 0.5
    # eight a node: 8 x 25 = 200 GB/s of NICs, against NVLink's 8/7 x 234.89 = 268: 200
    full = a100.ring_link(64, 64)
    assert full.bandwidth == pytest.approx(200e9) and full.alpha == a100.inter_node.alpha
    # NVLink binds when the NICs are faster: 8/7 x 234.89 GB/s
    fast_nics = a100.with_(inter_node=Link(10e-6, 100e9))
    assert fast_nics.ring_link(64, 64).bandwidth == pytest.approx(8 / 7 * 234.89e9)
    # the measured case of NVIDIA/nccl-tests issue 100: two HGX A100 nodes, 4 x 200 Gb/s
    # NICs each (12.5 GB/s a GPU): 91 GB/s measured bus bandwidth, 100 by this rule
    hgx = Hardware.dgx_a100(16, inter_node=Link(10e-6, 12.5e9))
    assert hgx.ring_link(16, 16).bandwidth == pytest.approx(100e9)
