"""Ways to split training over ranks, one module per parallelism: ``data`` with
``data_parallel`` and ``zero`` (ZeRO-1), ``sharded`` with ``fsdp`` (ZeRO-3 and HSDP; what it
shards over which ranks in ``fsdp_layout``) and ``Zero2``,
``tensor`` with ``tensor_ops``, ``pipeline`` with ``schedules`` and ``schedule_check``,
``context`` with ``context_ops`` (ring attention) and ``context_transformers`` (it as
the attention function of a Hugging Face model), ``experts`` (expert parallelism),
``combined`` on a ``mesh``, and for long runs ``checkpoint`` with ``checkpoint_pieces``
(sharded save and load with ``torch.distributed.checkpoint``, resharding) and ``token_loss``
(the loss normalised by the global count of real tokens): the code a reader could lift into
a training script. They import only torch, :mod:`parlib.comm`, the pure formulas of
:mod:`parlib.cost`, :mod:`parlib.model` and each other (``context_transformers`` imports
transformers when asked to register); measuring them is :mod:`parlib.experiments`' job.
"""
