"""``python -m kvoffload_ref`` runs the command-line interface."""

from kvoffload_ref.cli import main

raise SystemExit(main())
