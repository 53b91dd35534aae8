"""``python -m objckpt`` is the ``objckpt`` command."""

from .cli import main

raise SystemExit(main())
