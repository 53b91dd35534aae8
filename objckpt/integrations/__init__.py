"""Plug-ins that make training frameworks save through objckpt (see docs/INTEGRATIONS.md).

=================================  ============================================  =====================
plug-in                            attach                                        needs
=================================  ============================================  =====================
``lightning.ObjckptCheckpointIO``  ``Trainer(plugins=[ObjckptCheckpointIO(uri)])``  ``lightning>=2.6``
``deepspeed.ObjckptCheckpointEngine``  ``ObjckptCheckpointEngine.attach(engine, uri)``  ``deepspeed>=0.19``
``huggingface.ObjckptCallback``    ``Trainer(callbacks=[ObjckptCallback(uri)])``   ``transformers>=5``
=================================  ============================================  =====================

Importing ``objckpt`` or this package needs none of the frameworks: each submodule imports its
framework when it is imported, and the names below are resolved on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ObjckptCallback", "ObjckptCheckpointEngine", "ObjckptCheckpointIO", "download_checkpoint"]

_LAZY = {
    "ObjckptCheckpointIO": "lightning",
    "ObjckptCheckpointEngine": "deepspeed",
    "ObjckptCallback": "huggingface",
    "download_checkpoint": "huggingface",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
