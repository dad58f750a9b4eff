"""Training scripts to start on a cluster with torchrun (``-m parlib.run MODULE:FUNCTION``):
the strategies put together into whole runs. ``long_run``: FSDP training that saves a
sharded checkpoint every few steps and, restarted after a rank dies, resumes from the newest.
"""
