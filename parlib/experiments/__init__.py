"""Experiments on the strategies: harnesses that launch, time, pad with emulated costs,
compare with the single-device reference and tabulate.

The strategies (``parlib.strategies``) are the code a reader could copy into a training
script; this layer wraps them for the course's measurements, one module per concept:
``data`` (one setup per gradient-sync kind), ``pipeline`` (hooks that record a timeline and
pad compute, one rank's experiment), ``torch_pipelining`` (the same stages under torch's own
schedules, raced side by side), ``simulate`` (ideal schedule timelines), ``schedule_lab``
(every schedule measured next to its simulation and formula), ``combined`` (a 3-D run and
its comparison with the reference), ``layouts`` (the choosing chapter's layouts),
``sharded`` (the ZeRO stages side by side: memory ledger, prefetch timeline, FSDP2),
``hsdp`` (sharded inside a group, replicated across: bytes per axis),
``context`` (attention checks, the causal imbalance, the model with the sequence split) and
``experts`` (expert-parallel traffic, drops, imbalance and training).
"""
