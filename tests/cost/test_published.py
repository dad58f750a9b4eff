"""The cost model against published runs (parlib.cost.published cites each source and table).

The presets run at their generation's achievable matmul fraction (parlib.cost.efficiency),
one number per generation, never tuned per run. The issue's target is reported / predicted
within 0.8-1.25 for 8 of 10 runs. With costcore at 80a5a3e (memory-bound ops charged, uneven
stages) the model reached 9 of 16, four of them at the band's edge. With the shape-dependent
matmul rate (output tiles in waves over the SMs, parlib.cost.efficiency.matmul_time) it
reached 10 of 16. With the Llama 3 rows interleaved as the paper's Sec. 3.3.2 says they ran
(Figure 6's v = 2, where the model's memory says it fits; v = 1 for the 8,192-GPU row, whose
32 microbatches' chunks would not) and the Megatron-LM rows at their script's microbatch and
interleaving (examples/sc21/run_table_1.sh; 0.89, 0.88, 0.84 at microbatch 1, v = 1) it
reaches 11 of 16: Megatron-LM 76.1B 0.81, 145.6B 0.83, 1008B 0.84; Korthikanti 175B 0.86,
530B 0.87, 1T 0.85; Llama 3 on 8,192 GPUs 1.01, on 16,384 0.97 and with CP 0.92 (1.27 and
1.21 at v = 1); torchtitan 70B 0.94; MPT 30B 0.84. Below the band: Korthikanti 22B 0.80
(0.796), BLOOM 0.78, OPT 0.73, torchtitan 8B 0.73, MPT 7B 0.66 (the model is optimistic on
the smaller, faster-stepping runs). With ZeRO-3's traffic overlapped by phase (backward
traffic behind backward compute only) and the torchtitan rows as their code ran them (fp32
gradient reduce-scatter; the "op" policy's recomputed matmuls) torchtitan 8B goes from 0.73
to 0.92 (0.80 from the recomputed matmuls alone; the exposed fp32 reduce-scatter the rest):
12 of 16. That exposed part rested on the model's ring then, which charged each rank's
whole share of an all-reduce to its own NIC. NCCL's rings leave a node through all of its
NICs at once (parlib.cost.hardware.Hardware.ring_link): with that, NVLink at each
generation's measured fraction (A100 78%, H100 82%) and Jean Zay's network as BigScience
measured it (a node's rings share 5.06 GB/s), 13 of 16: Megatron-LM 0.84, 0.85, 0.85;
Llama 3 1.04, 1.00, 0.93; Korthikanti 22B 0.83, 175B 0.88, 530B 0.88, 1T 0.86; BLOOM 0.98;
torchtitan 70B 0.94; MPT 30B 0.84. Below the band: OPT 0.75, torchtitan 8B 0.79 (its
fp32 reduce-scatter now hides behind its backward: the recomputed matmuls are what is left
of the change), MPT 7B 0.66. With each generation's training fractions fitted to every
published row of it (parlib.cost.calibration: matmuls at 82% of MAMF on A100s and 88% on H100s,
the layers' memory-bound work at 67% and 23% of the datasheet, large streaming kernels at 90%),
15 of 16, 0.93-1.28 (above: Llama 3 on 8,192 GPUs, whose v = 1 bubble is an upper bound).
test_agreement_does_not_regress guards that count.
"""

import dataclasses

import pytest

from parlib.cost.estimate import estimate
from parlib.cost.published import (
    LLAMA_CHUNKS,
    LLAMA_RUNS,
    MEGATRON_RUNS,
    RUNS,
    TARGET_BAND,
    TORCHTITAN_RUNS,
    PublishedRun,
    agreement,
    caveats_table,
    comparison_table,
)

# What the model reaches today (see the module docstring); raise it when the model improves.
RUNS_IN_BAND_AT_LEAST = 15
# A run far outside this is a broken row or a broken model, not a modelling limit.
SANITY_BAND = (0.45, 1.3)


def test_enough_runs_from_enough_sources():
    assert len(RUNS) >= 10
    sources = {run.source.split(",")[0].split(":")[0].split(" (")[0] for run in RUNS}
    assert len(sources) >= 5, sources
    assert len({run.name for run in RUNS}) == len(RUNS)


def test_the_tables_print_one_row_per_run():
    table = comparison_table()
    print("\n" + table + "\n\n" + caveats_table())
    assert len(table.splitlines()) == len(RUNS) + 2
    inside, total = agreement()
    assert table.splitlines()[-1].startswith(f"{inside} of {total} runs")
    assert len(caveats_table().splitlines()) == len(RUNS)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_published_run_is_well_formed_and_fits(run):
    est = run.estimate()
    predicted = run.predicted(est)
    print(f"\n{run.name}: predicted {run.metric.upper()} {predicted:.1%}, reported "
          f"{run.reported:.1%}, ratio {run.ratio(est):.2f}; {est.memory_total / 1e9:.1f} GB\n"
          f"  source: {run.source}\n  assumed: {run.assumed}\n  cannot know: {run.cannot_know}")
    assert run.source and run.assumed and run.cannot_know
    if run.reported_params is not None:  # our parameter count reproduces the table's
        assert round(run.model.n_params / 1e9, 1) == run.reported_params
    assert est.fits, est.reason
    assert est.hardware.n_devices == est.layout.world == run.layout.world
    assert est.hardware.compute_efficiency < 1  # one achievable fraction per generation
    assert SANITY_BAND[0] <= run.ratio(est) <= SANITY_BAND[1]
    # the source's own rate is its utilisation of the same datasheet peak we use
    if run.reported_tflops_per_device is not None:
        assert run.reported_tflops_per_device * 1e12 / est.hardware.peak_flops == pytest.approx(
            run.reported, abs=0.01)
    if run.reported_tokens_per_second_per_device is not None:
        # reported is the source's tokens/s under our FLOP count; the source's own MFU (it
        # counts the embedding's parameters too) is at most 7% above it
        flops = run.reported_tokens_per_second_per_device * run.model.flops_per_token
        assert flops / est.hardware.peak_flops == pytest.approx(run.reported)
        stated = float(run.source.split("% MFU")[0].rsplit(" ", 1)[1]) / 100
        assert run.reported < stated < 1.07 * run.reported


def test_the_comparison_is_computed_from_estimate():
    run = RUNS[0]
    est = estimate(run.model, run.hardware, run.layout, **run.settings)
    assert run.predicted() == pytest.approx(est.hfu)
    assert run.ratio() == pytest.approx(run.reported / est.hfu)
    # half the achievable compute: the prediction moves, so nothing in it is a constant
    slower = dataclasses.replace(run, hardware=run.hardware.with_(
        compute_efficiency=run.hardware.compute_efficiency / 2))
    assert slower.predicted() < 0.65 * run.predicted()
    assert slower.ratio() > 1.6 * run.ratio()
    assert str(round(run.ratio(), 2)) in comparison_table((run,))


def test_agreement_counts_the_band():
    run = RUNS[0]
    assert agreement((run,), band=(0.0, 10.0)) == (1, 1)
    assert agreement((run,), band=(run.ratio() + 0.01, 10.0)) == (0, 1)


def test_agreement_does_not_regress():
    inside, total = agreement(band=TARGET_BAND)
    print(f"\n{inside} of {total} runs within {TARGET_BAND}")
    assert inside >= RUNS_IN_BAND_AT_LEAST


def test_a_malformed_run_is_refused():
    run = RUNS[0]
    with pytest.raises(ValueError, match="metric"):
        dataclasses.replace(run, metric="tflops")
    with pytest.raises(ValueError, match="fraction of peak"):
        dataclasses.replace(run, reported=45)
    assert isinstance(run, PublishedRun)


def test_llama_rows_interleave_where_the_model_says_it_fits():
    # the paper interleaved (V unstated): Figure 6's v where it fits, else v = 1, said so
    for run in LLAMA_RUNS:
        v = run.settings["v"]
        assert v in (1, LLAMA_CHUNKS)
        at_chunks = estimate(run.model, run.hardware, run.layout,
                             **{**run.settings, "v": LLAMA_CHUNKS})
        assert (v == LLAMA_CHUNKS) == at_chunks.fits, run.name
        assert f"v = {v}" in run.assumed
        if v == 1:
            assert "upper bound" in run.assumed
    # the 8,192-GPU row's 32 microbatches do not fit interleaved; the 16,384-GPU rows do
    assert [run.settings["v"] for run in LLAMA_RUNS] == [1, LLAMA_CHUNKS, LLAMA_CHUNKS]
    # interleaving shrinks the bubble the v = 1 row charges
    run = LLAMA_RUNS[1]
    plain = estimate(run.model, run.hardware, run.layout, **{**run.settings, "v": 1})
    assert run.estimate().time["pp_bubble"] < 0.6 * plain.time["pp_bubble"]


def test_megatron_rows_run_their_scripts_microbatch_and_chunks():
    # examples/sc21/run_table_1.sh: 76B MBS 2, 5 layers per virtual stage; 145B MBS 2, 5;
    # 1T MBS 1, not interleaved
    expected = {60: (2, 3), 80: (2, 2), 128: (1, 1)}  # by layer count
    for run in MEGATRON_RUNS:
        micro_batch, v = expected[run.model.n_layers]
        est = run.estimate()
        assert (est.micro_batch, est.v) == (micro_batch, v), run.name
        assert run.model.n_layers % (run.layout.pp * v) == 0
        assert f"MBS {micro_batch}" in run.source


def test_torchtitan_rows_run_as_their_code_did():
    eight, seventy = TORCHTITAN_RUNS
    # Llama 3 8B, the "op" policy: wk (h x kv), wo (h x h) and w3 (h x f) rerun, per layer
    # 2 x 4096 x (1024 + 4096 + 14336) = 159,383,552 FLOPs a token; 32 layers
    assert eight.model.op_policy_flops_per_token == 32 * 159_383_552 == 5_100_273_664
    assert eight.settings["recompute"] == "op" and seventy.settings["recompute"] is True
    # FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.float32): 4 bytes per gradient
    assert eight.settings["grad_reduce_bytes"] == seventy.settings["grad_reduce_bytes"] == 4
    est = eight.estimate()
    plain = estimate(eight.model, eight.hardware, eight.layout, m=1, global_batch=64, zero=3,
                     fused_attention=True)
    # the recomputed matmuls are hardware FLOPs (HFU), not model FLOPs (MFU); attention's
    # output is kept, so attention is not rerun
    assert est.model_flops == plain.model_flops
    tokens = 64 * 8192
    assert est.hardware_flops == pytest.approx(plain.hardware_flops + 5_100_273_664 * tokens)
    # fp32 gradients double the reduce-scatter; its bytes are a third of the sync in bf16
    assert est.bytes_sent["dp"] == pytest.approx(plain.bytes_sent["dp"] * 4 / 3)
    assert est.time["dp_sync_total"] > plain.time["dp_sync_total"]
    with pytest.raises(ValueError, match="dense layers only"):
        _ = dataclasses.replace(RUNS[0].model, n_experts=8, top_k=2).op_policy_flops_per_token
