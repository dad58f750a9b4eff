"""Serial kernel launches: what a step pays when every kernel waits for the host.

Normally the host (Python, the framework, the CUDA driver) queues kernels ahead of the GPU,
so the host's time per operation hides under the GPU's. With ``CUDA_LAUNCH_BLOCKING=1``
every launch returns only when its kernel has finished: the GPU idles while the host
prepares the next operation, and the host's time adds to the GPU's instead of hiding
under it. It is a debugging setting, but BigScience trained BLOOM with it: on 40 or more of
Jean Zay's nodes their jobs hung without it (bigscience-workshop/bigscience,
train/tr11-176B-ml/README.md, "Important environment variables"; tr11-176B-ml.slurm: "do
not remove or the training will hang"), so every 48-node run they timed ran with it.

What it costs was measured once where a job could run both ways (chronicles-prequel.md,
"dealing with JZ hanging on the large model"): the 200B model (80 layers of 14,400, t = 8,
p = 10, one sequence a microbatch), global batch 512 on 80 GPUs, reached 97.20 TFLOPs with
launches queued and 91.04 with them serial. The same model on the same 80 GPUs took 853.81 s
a step at global batch 2048 and 97.82 TFLOPs (the 02-17 log line), which turns those rates
into seconds: 214.8 s and 229.3 s, 14.5 s apart (:func:`host_seconds_per_layer`).

Why that difference is the least a serial run pays: queued launches can hide at most the
host's own time, so the 14.5 s are at most the host's time, which serial launches expose
whole. Spread over the critical path's layer passes, (m + p - 1) x L/p = 521 x 8
microbatch-layers, that is 3.49 ms each (the host launches the same operations for a layer
pass whatever the microbatch, the cluster or t > 1, so its time per pass is the same). At
160 GPUs the two settings timed alike (84.59 against 84.44 TFLOPs at global batch 512,
90.29 against 90.25 at 2048): queued launches hid nothing there, which the bound allows;
BigScience's README says the setting made "a tiny impact or no impact at all". So the term
is a floor, from one pair of readings.

:func:`~parlib.cost.estimate.estimate` charges it through ``host_seconds_per_layer``: that
many seconds on every layer pass of every microbatch, on the critical path (so a pipeline's
bubble grows with it). Only runs that set serial launches pass it; the planner never does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SerialLaunchPair:
    """One job timed with launches queued and serial: its pipeline (``layers`` in ``stages``
    stages, ``microbatches`` a step per pipeline), both rates (TFLOPs per GPU, the source's
    count) and one step's seconds at a known rate of the same model on the same GPUs
    (``reference_seconds`` for ``reference_microbatches`` at ``reference_tflops``)."""

    source: str
    layers: int
    stages: int
    microbatches: int
    queued_tflops: float
    serial_tflops: float
    reference_seconds: float
    reference_microbatches: int
    reference_tflops: float

    def __post_init__(self) -> None:
        for name in ("layers", "stages", "microbatches", "reference_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SerialLaunchPair: {name} must be an int >= 1, got {value!r}")
        for name in ("queued_tflops", "serial_tflops", "reference_seconds",
                     "reference_tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SerialLaunchPair: {name} must be > 0, got "
                                 f"{getattr(self, name)!r}")
        if self.layers % self.stages:
            raise ValueError(f"SerialLaunchPair: {self.layers} layers do not split evenly "
                             f"into {self.stages} stages")

    def seconds(self, tflops: float) -> float:
        """One step of ``microbatches`` at ``tflops``: the reference step scaled by the
        sequences (a step's FLOPs grow with them) and by the rate."""
        return (self.reference_seconds * self.microbatches / self.reference_microbatches
                * self.reference_tflops / tflops)

    @property
    def layer_passes(self) -> int:
        """Microbatch-layers on the critical path: (m + p - 1) slots of L/p layers."""
        return (self.microbatches + self.stages - 1) * (self.layers // self.stages)


# chronicles-prequel.md: the 200B (80 x 14400, TP 8, PP 10, DP 1, MBS 1) at GBS 512 on 80
# GPUs, queued ("async yes") 97.20 and serial ("no") 91.04 TFLOPs; the bf16 "10 nodes, 1
# replica" log line of the same model: 853.81 s per iteration at GBS 2048, 97.82 TFLOPs.
BIGSCIENCE_80_GPUS = SerialLaunchPair(
    source=("bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md, "
            "'dealing with JZ hanging on the large model' (80 GPUs, GBS 512) and the bf16 "
            "10-node log line (853.81 s, GBS 2048, 97.82 TFLOPs)"),
    layers=80, stages=10, microbatches=512, queued_tflops=97.20, serial_tflops=91.04,
    reference_seconds=853.81, reference_microbatches=2048, reference_tflops=97.82)


def host_seconds_per_layer(pair: SerialLaunchPair = BIGSCIENCE_80_GPUS) -> float:
    """The least a serial run pays per layer pass of a microbatch: the serial step's extra
    seconds over the queued one's, over the critical path's microbatch-layers."""
    extra = pair.seconds(pair.serial_tflops) - pair.seconds(pair.queued_tflops)
    if extra < 0:
        raise ValueError(f"{pair.source}: the serial run was faster; no host time to charge")
    return extra / pair.layer_passes


# What BigScience's 48-node runs pay (Jean Zay, CUDA_LAUNCH_BLOCKING=1): 3.49 ms.
SERIAL_LAUNCH_SECONDS_PER_LAYER = host_seconds_per_layer()

__all__ = ["BIGSCIENCE_80_GPUS", "SERIAL_LAUNCH_SECONDS_PER_LAYER", "SerialLaunchPair",
           "host_seconds_per_layer"]
