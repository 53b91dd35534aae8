"""``CheckpointManager.restore`` of a checkpoint written through DCP (:mod:`.dcp`).

A DCP checkpoint (FSDP2 / DTensor state saved with ``save_sharded``) holds tensors by their
global shape, split into whatever pieces the saving ranks held. Restoring *modules* from it into
plain, unsharded modules -- evaluating or exporting on one process what a sharded job trained --
goes through DCP's own resharding: every requested tensor is read at its full global shape,
whatever world size wrote it. The entry ``state[name]`` is the DCP state dict's top-level key
``name`` (``save_sharded({"model": get_model_state_dict(model), ...})`` -> ``{"model": net}``).

Only ``nn.Module`` entries are restored here; optimizers and the rest of a DCP checkpoint are
loaded with :func:`~objckpt.training.dcp.load_sharded` into ``get_state_dict`` output, where
DCP knows their sharding. No RNG is restored (DCP checkpoints hold none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TrainingStateError
from ..manifest import Manifest
from ..store import Store
from .state import MODULE, RestoreReport, _head, classify, unwrap_module

__all__ = ["stage_dcp"]


def stage_dcp(
    store: Store, manifest: Manifest, state: Mapping[str, Any], *, rank: int, strict: bool = True
) -> tuple[dict[str, Any], RestoreReport]:
    """Read the modules of ``state`` from the DCP checkpoint ``manifest`` into new full-size
    tensors (the live modules are not modified); returns their state dicts and the report.

    Raises:
        TrainingStateError: an entry is not an ``nn.Module`` or holds sharded (DTensor)
            parameters, a key or shape does not match (``strict``), naming the step, rank and key.
        IntegrityError, NotFoundError: the checkpoint is damaged (the restore session falls back).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from .dcp import ObjckptStorageReader
    from .dcp.api import _failures, _load_error

    where = (
        f"checkpoint step {manifest.step} (written through DCP by {manifest.world_size} rank(s)), rank {rank}"
    )
    reader = ObjckptStorageReader(store, manifest=manifest)
    saved = reader.read_metadata().state_dict_metadata
    report = RestoreReport()
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for name, obj in state.items():
        if classify(name, obj) != MODULE:
            raise TrainingStateError(
                f"{where}: state[{name!r}] is a {type(obj).__qualname__}; CheckpointManager restores only "
                "nn.Module entries from a DCP checkpoint (load the rest with objckpt.training.dcp.load_sharded)"
            )
        prefix = f"{name}."
        keys = {fqn[len(prefix) :]: meta for fqn, meta in saved.items() if fqn.startswith(prefix)}
        if not keys:
            if strict:
                tops = sorted({fqn.split(".", 1)[0] for fqn in saved})
                raise TrainingStateError(
                    f"{where}: the checkpoint has no state for {name!r} (its top-level keys are {tops})"
                )
            report.missing_entries.append(name)
            continue
        live = unwrap_module(obj).state_dict()
        missing = [k for k in live if k not in keys]
        unexpected = [k for k in keys if k not in live]
        if (missing or unexpected) and strict:
            raise TrainingStateError(
                f"{where}: state[{name!r}] does not match the checkpoint: missing keys {_head(missing)}, "
                f"unexpected keys {_head(unexpected)} (restore(..., strict=False) loads the keys both have)"
            )
        if missing:
            report.missing_keys[name] = missing
        if unexpected:
            report.unexpected_keys[name] = unexpected
        target: dict[str, torch.Tensor] = {}
        for key, tensor in live.items():
            meta = keys.get(key)
            if meta is None or not isinstance(tensor, torch.Tensor):
                continue
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                raise TrainingStateError(
                    f"{where}: state[{name!r}] tensor {key!r} is a {type(tensor).__qualname__}: restore "
                    "sharded modules with objckpt.training.dcp.load_sharded"
                )
            if not isinstance(meta, TensorStorageMetadata):
                raise TrainingStateError(
                    f"{where}: state[{name!r}] key {key!r} is not a tensor in the checkpoint"
                )
            if tuple(meta.size) != tuple(tensor.shape):
                raise TrainingStateError(
                    f"{where}: state[{name!r}] tensor {key!r} has shape {tuple(meta.size)} in the checkpoint "
                    f"but {tuple(tensor.shape)} in the model"
                )
            target[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        targets[name] = target
    if targets:
        try:
            dcp_load(targets, storage_reader=reader)
        except CheckpointException as cpe:
            raise _load_error(_failures(cpe), reader) from cpe
    return dict(targets), report
