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
from parlib.cost.model import Model
from parlib.cost.published import PublishedRun, llama, torchtitan_run

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


__all__ = ["MEMORY_FACTS", "MemoryFact", "held_out_runs", "memory_agreement", "memory_table"]
