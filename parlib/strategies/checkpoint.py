"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save the course's sharded
states where every rank writes only its own shard, load them on any number of ranks.

    save_checkpoint(path, fsdp, opt, extra={"step": step})   # every rank, together
    ...                                                       # later, on 2 ranks or on 8:
    extra = load_checkpoint(path, fsdp, opt)                  # every rank, together

What a checkpoint holds: the model's parameters and buffers (``model.<name>``), the
optimizer's state (``optim.<name>.exp_avg``, ``.step``, ...; its hyperparameters in
``optim.param_groups``) and ``extra``, small values equal on every rank (the step, the data
position, a shared RNG state) under ``extra.<key>``, each saved once and whole (DCP's
flattening of nested dicts is off), tensors as tensors, anything else pickled.
Gradients are not saved: the next step recomputes them.

How each rank's tensors are described to DCP (a view of a flat vector, sharded as a ``DTensor``
or, for a row-parallel weight, a ``ShardedTensor``) is :mod:`parlib.strategies.checkpoint_pieces`.

``group``: the ranks that save (and load) the checkpoint together; DCP's collectives run on
it (for ``async_save_checkpoint``, give it a group of its own, so that the background save
never interleaves with training's collectives). The shards' mesh is each strategy's own
group.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from parlib.strategies.checkpoint_pieces import (
    FlatPiece,
    RowsOfColumnsPiece,
    model_pieces,
    optimizer_pieces,
    sharded_tensors_quiet,
    unwrapped,
)
from parlib.strategies.pipeline import ChunkedStage, Stage

MODEL, OPTIM, EXTRA = "model.", "optim.", "extra."
HYPERPARAMETERS = OPTIM + "param_groups"


class SavedObject:
    """A value that is not a tensor (the hyperparameters, ``extra``), saved whole by DCP.
    DCP restores only tensors in place; anything else it hands to ``load_state_dict`` of an
    object that has one (a ``Stateful``), as this box."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _hyperparameter_owner(optimizer: Any) -> Any:
    """Whose param_groups hold the hyperparameters: Zero2's inner optimizer, else its own."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def _inner(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose ``state`` is keyed by the stepped tensors."""
    return getattr(optimizer, "optimizer", None) if hasattr(optimizer, "shards") else optimizer


def optimizer_state(optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """The optimizer's part of :func:`checkpoint_state`: every state tensor shaped like its
    parameter described as the parameter is, scalars (Adam's step) whole, and the
    hyperparameters of each group."""
    inner = _inner(optimizer)
    state: dict[str, Any] = {}
    for key, p, piece in optimizer_pieces(optimizer, model):
        for name, value in ({} if inner is None else inner.state.get(p, {})).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                state[f"{OPTIM}{key}.{name}"] = piece.view(value)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                state[f"{OPTIM}{key}.{name}"] = value
            else:
                raise ValueError(f"checkpoint: optimizer state {key}.{name} is neither shaped "
                                 "like its parameter nor a scalar; it cannot be resharded")
    state[HYPERPARAMETERS] = SavedObject([{k: v for k, v in g.items() if k != "params"}
                                          for g in _hyperparameter_owner(optimizer).param_groups])
    return state


def checkpoint_state(model: nn.Module, optimizer: Any = None,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The flat dict DCP saves and loads in place: ``model.<name>``, ``optim.<...>`` and
    ``extra.<key>`` (see the module docstring). Its tensors share storage with the model's
    and the optimizer's, so ``dcp.load`` into it restores them."""
    state = {MODEL + name: piece.view(t) for name, t, piece in model_pieces(model)}
    if optimizer is not None:
        state.update(optimizer_state(optimizer, model))
    state.update({EXTRA + k: v if isinstance(v, torch.Tensor) else SavedObject(v)
                  for k, v in (extra or {}).items()})
    return state


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
                    extra: Mapping[str, Any] | None = None, group: Any = None) -> None:
    """Every rank of ``group`` writes its shards of ``model`` and ``optimizer`` (and one copy
    of what is held whole) into the folder ``path``; returns when all are written."""
    with sharded_tensors_quiet():
        dcp.save(checkpoint_state(model, optimizer, extra), checkpoint_id=path,
                 process_group=group, planner=DefaultSavePlanner(flatten_state_dict=False))


def async_save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any = None,
                          *, extra: Mapping[str, Any] | None = None, group: Any = None,
                          stats: dict[str, Any] | None = None) -> Future:
    """:func:`save_checkpoint` in the background (``dcp.async_save``): returns once the
    state is copied to a staging buffer, so training may change the weights; ``.result()``
    on the returned future waits until it is on disk. Give it a ``group`` of its own.
    ``stats``: a dict that receives ``staged_bytes``, the memory the staging copy holds
    on this rank until the write ends (:class:`CountingStager`)."""
    stager = CountingStager()
    with sharded_tensors_quiet():
        future = dcp.async_save(checkpoint_state(model, optimizer, extra), checkpoint_id=path,
                                process_group=group, async_stager=stager,
                                planner=DefaultSavePlanner(flatten_state_dict=False))
    stager.close()  # it staged synchronously: the copy is made, its executor not needed
    if stats is not None:
        stats["staged_bytes"] = stager.staged_bytes
    return future


class CountingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (no flattening: the state is flat already) that counts
    the tensor bytes this rank's plan reads, in ``read_bytes``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.read_bytes = 0

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        saved = self.metadata.state_dict_metadata
        self.read_bytes = sum(math.prod(item.lengths)
                              * saved[item.storage_index.fqn].properties.dtype.itemsize
                              for item in plan.items if item.type == LoadItemType.TENSOR)
        return plan


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
                    group: Any = None, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the checkpoint in ``path`` into ``model`` and ``optimizer`` in place, on any
    world size (each rank reads the slices of its shards); returns the saved ``extra``.
    Without ``optimizer``, only the weights (to evaluate, or to fine-tune afresh).
    ``stats``: a dict that receives ``read_bytes``, the tensor bytes this rank read."""
    with sharded_tensors_quiet():
        return _load(path, model, optimizer, group, stats)


def _load(path: str | os.PathLike, model: nn.Module, optimizer: Any, group: Any,
          stats: dict[str, Any] | None) -> dict[str, Any]:
    metadata = dcp.FileSystemReader(path).read_metadata()
    if optimizer is not None:
        _create_optimizer_state(optimizer, model, metadata)
    state = checkpoint_state(model, optimizer, _saved_extra(metadata))
    stage = isinstance(unwrapped(model), (Stage, ChunkedStage))
    _check_keys(state, metadata, path, optimizer is not None, part_of_model=stage)
    planner = CountingLoadPlanner()
    dcp.load(state, checkpoint_id=path, process_group=group, planner=planner)
    if stats is not None:
        stats["read_bytes"] = planner.read_bytes
    if optimizer is not None:
        owner, saved_groups = _hyperparameter_owner(optimizer), state[HYPERPARAMETERS].value
        if len(saved_groups) != len(owner.param_groups):
            raise ValueError(f"load_checkpoint: {path} has {len(saved_groups)} parameter "
                             f"groups, this optimizer {len(owner.param_groups)}")
        for group_now, saved in zip(owner.param_groups, saved_groups):
            group_now.update(saved)
    for shard in getattr(optimizer, "shards", None) or []:
        shard.read_params()  # Zero2 steps its shard copy: it must see the loaded weights
    return {k[len(EXTRA):]: v.value if isinstance(v, SavedObject) else v
            for k, v in state.items() if k.startswith(EXTRA)}


def _saved_extra(metadata: Metadata) -> dict[str, Any]:
    """Where to load each saved ``extra`` value: a tensor of its size, or nothing yet."""
    return {key[len(EXTRA):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            if isinstance(meta, TensorStorageMetadata) else None
            for key, meta in metadata.state_dict_metadata.items() if key.startswith(EXTRA)}


@torch.no_grad()
def _create_optimizer_state(optimizer: Any, model: nn.Module, metadata: Metadata) -> None:
    """Give a fresh optimizer (no step taken: no state yet) the state tensors the checkpoint
    has, zeros of the right shape, for DCP to load into."""
    inner = _inner(optimizer)
    saved = metadata.state_dict_metadata
    for key, p, piece in optimizer_pieces(optimizer, model):
        prefix = f"{OPTIM}{key}."
        for full_key, meta in saved.items():
            if not full_key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            dtype = meta.properties.dtype
            if tuple(meta.size) == (piece.numel,):
                value = torch.zeros(p.shape, dtype=dtype, device=p.device)
            else:  # a scalar (Adam's step): on the CPU, as torch's optimizers keep it
                value = torch.zeros(tuple(meta.size), dtype=dtype)
            inner.state[p].setdefault(full_key[len(prefix):], value)


STEP_PREFIX = "step-"


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint taken after ``step`` steps goes: ``folder/step-00000042``."""
    return Path(folder) / f"{STEP_PREFIX}{step:08d}"


def latest_checkpoint(folder: str | os.PathLike) -> tuple[int, Path] | None:
    """The newest complete checkpoint in ``folder`` (as :func:`checkpoint_path` names them):
    (its step, its path), or None. DCP writes the ``.metadata`` file last, once every rank
    has written its shards, so a save cut short by a dead rank has none and is skipped."""
    found = []
    for path in Path(folder).glob(f"{STEP_PREFIX}*"):
        step = path.name[len(STEP_PREFIX):]
        if step.isdigit() and (path / ".metadata").is_file():
            found.append((int(step), path))
    return max(found) if found else None


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _check_keys(state: dict[str, Any], metadata: Metadata, path: Any,
                with_optimizer: bool, part_of_model: bool) -> None:
    """A clear error for a checkpoint of another model or strategy (DCP's own would name one
    missing key, and say nothing of keys this model does not load). Without an optimizer,
    the optimizer's part of the checkpoint is left unread; a pipeline stage reads its part."""
    saved = metadata.state_dict_metadata
    loaded = (MODEL, OPTIM) if with_optimizer else (MODEL,)
    missing = sorted(k for k in state if k not in saved)
    unused = [] if part_of_model else sorted(
        k for k in saved if k not in state and k.startswith(loaded))
    if missing or unused:
        raise ValueError(
            f"load_checkpoint: {path} does not fit this model and optimizer: "
            + (f"it lacks {_listed(missing)}; " if missing else "")
            + (f"it holds {_listed(unused)}, which they have not; " if unused else "")
            + "it was saved from another model or strategy (Zero1 and Zero2 keep their "
            "optimizer state per flat vector, FSDP and plain optimizers per parameter)")
    for key, value in state.items():
        meta = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata):
            if tuple(meta.size) != tuple(value.shape):
                raise ValueError(f"load_checkpoint: {key} has shape {tuple(meta.size)} in "
                                 f"{path}, {tuple(value.shape)} here: another model's")


def storage_bytes(state: Any) -> int:
    """The bytes of storage the tensors in ``state`` hold (a DTensor's or ShardedTensor's
    local pieces; dicts and lists searched), each storage counted once, whole: a view of
    part of a tensor holds all of its storage."""
    storages: dict[int, int] = {}
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, DTensor):
            stack.append(value.to_local())
        elif hasattr(value, "local_shards"):  # a ShardedTensor
            stack.extend(shard.tensor for shard in value.local_shards())
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class CountingStager(DefaultStager):
    """DCP's default stager as ``dcp.async_save`` makes it on the CPU (a synchronous copy,
    no pinned or shared memory) that records ``staged_bytes``: the storage its copy holds
    (:func:`storage_bytes`). It copies each piece's whole storage, so a shard's padding
    is staged too."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(False, False, False, False))
        self.staged_bytes = 0

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        staged = super().stage(state_dict, **kwargs)
        self.staged_bytes = storage_bytes(staged)
        return staged


__all__ = ["CountingLoadPlanner", "CountingStager", "FlatPiece", "RowsOfColumnsPiece",
           "STEP_PREFIX", "SavedObject", "async_save_checkpoint", "checkpoint_path",
           "checkpoint_state", "latest_checkpoint", "load_checkpoint", "model_pieces",
           "optimizer_state", "save_checkpoint", "storage_bytes"]
