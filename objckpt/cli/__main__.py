"""``python -m objckpt.cli`` is the ``objckpt`` command."""

from . import main

raise SystemExit(main())
