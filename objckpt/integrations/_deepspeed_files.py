"""DeepSpeed's files, seen from objckpt: tags and steps, local paths and shard names.

DeepSpeed knows a checkpoint as a folder ``save_dir/<tag>`` of ``torch.save`` files plus a
``latest`` file naming the tag; objckpt knows it as a step whose shards have portable names.
This module holds that mapping and nothing that touches the store or the other ranks:

* tag -> step (:func:`step_from_tag`) and manifest -> tag (:func:`_tag_of`, from the
  ``metadata["deepspeed"]["tag"]`` every commit records);
* a saved file's path -> its shard name (:func:`_shard_name`), and a loaded path -> tag and
  name (:func:`_split_path`);
* the local ``latest`` file, written atomically (:func:`_write_atomic`);
* the DeepSpeed classes its files may hold (:data:`SAFE_GLOBALS`, resolved by
  :func:`_resolve_globals` for ``torch.load(weights_only=True)``).

Separate from :mod:`.deepspeed` (the ``CheckpointEngine`` and :func:`.deepspeed.load_checkpoint`,
which drive the save and restore sessions) for length; the public names here are importable from
:mod:`.deepspeed`, where callers have always found them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .. import layout
from ..errors import NoCheckpointError
from ..manifest import Manifest

__all__ = ["SAFE_GLOBALS", "step_from_tag"]

# the plug-in's one logger: its records keep the name users configure and filter on
log = logging.getLogger("objckpt.integrations.deepspeed")

#: DeepSpeed classes found inside ZeRO-1/2 checkpoints (DeepSpeed 0.19): loss scaler, the ZeRO
#: stage enum, and the fragment addresses of ``param_slice_mappings``
SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
)


def step_from_tag(tag: str) -> int:
    """The trailing integer of a DeepSpeed tag: ``global_step20`` -> 20, ``"7"`` -> 7."""
    digits = ""
    for ch in reversed(str(tag)):
        if not ch.isdigit():
            break
        digits = ch + digits
    if not digits:
        raise ValueError(
            f"cannot tell the step of DeepSpeed tag {tag!r}: it does not end in an integer "
            "(use the default tag global_stepN, or pass step_of_tag=)"
        )
    return layout.check_step(int(digits))


def _resolve_globals(names: Iterable[Any]) -> list[Any]:
    import importlib

    out = []
    for item in names:
        if not isinstance(item, str):
            out.append(item)
            continue
        module, _, attr = item.partition(":")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            log.debug("safe global %s not available in this DeepSpeed", item)
    return out


# ------------------------------------------------------------------ paths and the latest file


def _shard_name(save_dir: str, tag: str, path: str) -> str:
    """The shard name of ``path``, a file DeepSpeed saves under ``save_dir/<tag>``.

    Raises:
        ValueError: ``path`` lies outside that folder (or is the folder itself).
    """
    folder = os.path.abspath(os.path.join(save_dir, tag))
    target = os.path.abspath(os.fspath(path))
    if os.path.commonpath([folder, target]) != folder or target == folder:
        raise ValueError(
            f"{path} lies outside the checkpoint folder {folder}; ObjckptCheckpointEngine commits "
            "only files of save_dir/tag (for save_16bit_model exports use DeepSpeed's "
            "TorchCheckpointEngine)"
        )
    return os.path.relpath(target, folder).replace(os.sep, "/")


def _split_path(path: str, known: Mapping[str, Manifest]) -> tuple[str, str]:
    """``.../<tag>/<name>`` -> ``(tag, name)``; ``name`` may have folders when a known tag is
    further up the path."""
    parts = os.path.normpath(os.fspath(path)).split(os.sep)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in known:
            return parts[i], "/".join(parts[i + 1 :])
    if len(parts) < 2:
        raise FileNotFoundError(f"{path}: not a <tag>/<file> path")
    return parts[-2], parts[-1]


def _tag_of(manifest: Manifest) -> str:
    info = manifest.metadata.get("deepspeed")
    if not isinstance(info, dict) or not isinstance(info.get("tag"), str):
        raise NoCheckpointError(f"step {manifest.step} ({manifest.key}) is not a DeepSpeed checkpoint")
    tag: str = info["tag"]
    return tag


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
