"""The coordination layer: how the ranks of a job agree on every save and restore (torch-free).

* :mod:`.comm` -- the :class:`Comm` protocol and two worlds without torch: :class:`LocalComm`
  (one process) and :class:`ThreadWorld` (N ranks as threads, for tests and the scale simulator).
  The torch.distributed implementation lives in :mod:`objckpt.training.dist`.
* :mod:`.save` -- :class:`SaveSession`, the one save protocol.
* :mod:`.restore` -- :class:`RestoreSession`, the one restore protocol.

Every integration (CheckpointManager, the DCP storage writer/reader, the Lightning, DeepSpeed and
Hugging Face plug-ins) is a thin adapter over these two sessions.
"""

from __future__ import annotations

from .comm import Comm, LocalComm, ThreadComm, ThreadWorld, agree
from .restore import Restored, RestoreSession
from .save import SaveSession, SaveTicket

__all__ = [
    "Comm",
    "LocalComm",
    "RestoreSession",
    "Restored",
    "SaveSession",
    "SaveTicket",
    "ThreadComm",
    "ThreadWorld",
    "agree",
]
