"""Published runs no fit has seen: the rest of torchtitan's table on 64 A100s, and what it
says about memory (layouts that ran, and one that did not), held against the model.

Source: torchtitan, docs/performance.md at commit 0413364 (the table whose two Llama 3 rows
are in :data:`~parlib.cost.published.RUNS`). Its Llama 2 table ran FSDP2 on 64 A100 80 GB
GPUs at sequence 4096, local batch 2 (global 128) unless said: 13B without checkpointing
2162 tokens/s per GPU, with the per-operation policy 1904; 70B with full checkpointing
2 sequences a GPU, 353; 70B with the per-operation policy 355 at one sequence a GPU,
because (its footnote 1) "the 70B training with local batch size 2 will cause an OOM error
when selective activation checkpointing is used". Its rows with "selective layer"
checkpointing (every second layer wholly recomputed) are left out: that policy is not one
the model names.

Two more rows measure memory itself: torchtitan's benchmarks/llama3_h100_202412_torchtitan.md
(end of 2024) ran Llama 3.1 8B with FSDP alone, local batch 2 at sequence 8192, selective
(per-operation) checkpointing, no torch.compile or Float8, on 8 and on 128 H100s of 96 GB,
and read the peak memory the allocator reserved (torchtitan logs ``max_reserved_gib``): 82.4
GiB on 8 GPUs, 67.0 on 128 (Tables 1 and 3). :func:`memory_reading_table` holds the model's
count against them: with the unfused loss's backward counted, 1.17-1.18 of it, the rest the
framework's buffers, the allocator's reserve and FSDP's gathered layers, which the model
leaves out by name (10.4-11.7 GiB, alike on 8 GPUs and on 128). (Its throughputs are not
used: those H100s ran at 500 W with HBM2e, a peak the table says it does not know.)

None of these rows is in the training shares' fit (:mod:`parlib.cost.calibration`), so
:func:`held_out_runs` tests the shares on rows they were not chosen for, and
:data:`MEMORY_FACTS` tests the memory model on the one thing a table states about memory
for certain: whether a layout ran. The model has no margin for framework buffers or
fragmentation (:mod:`parlib.cost.estimate`), so a layout it puts just under the memory can
still fail; :func:`memory_table` prints how far under each one is.
"""

from __future__ import annotations

from dataclasses import dataclass

from parlib.cost.estimate import Estimate, estimate
from parlib.cost.hardware import GB, Hardware
from parlib.cost.layout import Layout
from parlib.cost.memory import loss_peak_bytes
from parlib.cost.model import Model
from parlib.cost.published import PublishedRun, llama, torchtitan_run

GIB = 2**30  # torchtitan reads memory in GiB
_FOOTNOTE = ("torchtitan docs/performance.md (commit 0413364), footnote 1: the Llama 2 70B "
             "run with local batch size 2 and selective (per-operation) checkpointing ran "
             "out of memory")


def held_out_runs() -> tuple[PublishedRun, ...]:
    """torchtitan's Llama 2 rows on 64 A100s that the model can express."""
    return (
        torchtitan_run(llama("Llama 2", "13B"), 2, False, "no", 2162, 61.1,
                       name="Llama 2 13B, 64 A100 FSDP, no AC"),
        torchtitan_run(llama("Llama 2", "13B"), 2, "op", "selective op", 1904, 53.8,
                       name="Llama 2 13B, 64 A100 FSDP, op AC"),
        torchtitan_run(llama("Llama 2", "70B"), 1, "op", "selective op", 355, 50.8,
                       name="Llama 2 70B, 64 A100 FSDP, op AC"),
        torchtitan_run(llama("Llama 2", "70B"), 2, True, "full", 353, 50.5,
                       name="Llama 2 70B, 64 A100 FSDP, full AC"),
    )


@dataclass(frozen=True)
class MemoryFact:
    """A layout a source ran (``ran``) or saw run out of memory (not ``ran``)."""

    name: str
    model: Model
    hardware: Hardware
    layout: Layout
    settings: dict
    ran: bool
    source: str

    def estimate(self) -> Estimate:
        return estimate(self.model, self.hardware, self.layout, **self.settings)


def _fact(run: PublishedRun) -> MemoryFact:
    return MemoryFact(run.name, run.model, run.hardware, run.layout, run.settings, True,
                      run.source)


def _out_of_memory() -> MemoryFact:
    """Llama 2 70B, per-operation policy, two sequences a GPU: it did not run."""
    run = held_out_runs()[2]
    return MemoryFact("Llama 2 70B, 64 A100 FSDP, op AC, 2 a GPU", run.model, run.hardware,
                      run.layout, dict(run.settings, global_batch=128), False, _FOOTNOTE)


MEMORY_FACTS = tuple(_fact(r) for r in held_out_runs()) + (_out_of_memory(),)


def memory_agreement(facts: tuple[MemoryFact, ...] = MEMORY_FACTS) -> tuple[int, int]:
    """(facts where the model's "fits" says what happened, facts)."""
    return sum(f.estimate().fits == f.ran for f in facts), len(facts)


def memory_table(facts: tuple[MemoryFact, ...] = MEMORY_FACTS) -> str:
    """Per fact: the memory the model predicts for a device, the device's, whether the model
    says it fits, and what happened; then how many agree."""
    width = max(len(f.name) for f in facts)
    rows = [f"{'layout':<{width}} {'predicted GB':>12} {'of':>4} {'model':>13} {'source':>14}"]
    for f in facts:
        est = f.estimate()
        said = "fits" if est.fits else "does not fit"
        rows.append(f"{f.name:<{width}} {est.memory_total / GB:>12.1f} "
                    f"{f.hardware.memory_bytes / GB:>4.0f} {said:>13} "
                    f"{'ran' if f.ran else 'out of memory':>14}")
    agree, total = memory_agreement(facts)
    rows.append(f"the model says what happened for {agree} of {total}")
    return "\n".join(rows)


_READINGS = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama "
             "3.1 8B, FSDP, local batch 2, selective activation checkpointing, H100 96 GB")


@dataclass(frozen=True)
class MemoryReading:
    """A layout's peak memory per device as a source measured it (GiB, the allocator's
    reserve: what decides whether it runs)."""

    name: str
    fact: MemoryFact
    reported_gib: float

    def beyond_count_gib(self, est: Estimate | None = None) -> float:
        """GiB the measured peak ran beyond the model's count of the same layout."""
        return self.reported_gib - (est or self.fact.estimate()).memory_total / GIB


def memory_readings() -> tuple[MemoryReading, ...]:
    """torchtitan's Llama 3.1 8B on 8 and 128 H100s of 96 GB: FSDP2, local batch 2, the
    per-operation policy, gradients reduced in fp32 (what that code ran)."""
    model = llama("Llama 3", "8B")
    out = []
    for gpus, gib in ((8, 82.4), (128, 67.0)):
        hardware = Hardware.dgx_h100(gpus).with_(memory_bytes=96 * GB)
        settings = dict(m=1, global_batch=2 * gpus, zero=3, recompute="op",
                        grad_reduce_bytes=4, fused_attention=True)
        name = f"Llama 3.1 8B, {gpus} H100 FSDP, op AC, 2 a GPU"
        out.append(MemoryReading(name, MemoryFact(name, model, hardware, Layout(dp=gpus),
                                                  settings, True, _READINGS), gib))
    return tuple(out)


def _given_or_torchtitans(readings: tuple[MemoryReading, ...] | None, use: str
                          ) -> tuple[MemoryReading, ...]:
    """``readings``, or torchtitan's (:func:`memory_readings`) for None; none at all refused."""
    readings = memory_readings() if readings is None else readings
    if not readings:
        raise ValueError(f"no memory readings to {use} (pass None for torchtitan's)")
    return readings


def memory_reading_table(readings: tuple[MemoryReading, ...] | None = None) -> str:
    """Per reading: the model's count (with the unfused loss's backward peak, as torchtitan
    runs PyTorch's cross-entropy), the loss's share of it, and the measured peak, in GiB;
    then the range of measured / counted and of what the count leaves over."""
    readings = _given_or_torchtitans(readings, "tabulate")
    rows = [f"{'layout':<42} {'counted':>8} {'the loss':>9} {'measured':>9} "
            f"{'measured / counted':>19}"]
    ratios, over = [], []
    for r in readings:
        est, f = r.fact.estimate(), r.fact
        loss = loss_peak_bytes(f.model.seq_len, est.micro_batch, f.model.vocab_size,
                               t=f.layout.tp, loss=f.settings.get("loss", "unfused")) / GIB
        counted = est.memory_total / GIB
        ratios.append(r.reported_gib / counted)
        over.append(r.beyond_count_gib(est))
        rows.append(f"{r.name:<42} {counted:>8.1f} {loss:>9.1f} {r.reported_gib:>9.1f} "
                    f"{ratios[-1]:>19.2f}")
    rows.append(f"measured / counted {min(ratios):.2f}-{max(ratios):.2f}; "
                f"{min(over):.1f}-{max(over):.1f} GiB measured beyond the count")
    return "\n".join(rows)


def beyond_count_gib(readings: tuple[MemoryReading, ...] | None = None
                     ) -> tuple[float, float]:
    """(least, most) GiB the measured peaks of ``readings`` (:func:`memory_readings`) ran
    beyond the model's count: the buffers, reserve and gathered layers it leaves out. A
    layout with less than that to spare may not run though the count says it fits."""
    over = [r.beyond_count_gib() for r in _given_or_torchtitans(readings, "take the range from")]
    return min(over), max(over)


__all__ = ["GIB", "MEMORY_FACTS", "MemoryFact", "MemoryReading", "beyond_count_gib",
           "held_out_runs", "memory_agreement", "memory_reading_table", "memory_readings",
           "memory_table"]
