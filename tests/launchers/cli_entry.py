"""Run the ``openlab`` CLI with the ``job`` and ``backends`` groups mounted.

The main CLI mounts them itself once wired; until then (and to keep these tests
independent of that wiring) this entry adds them when they are missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.cli import backends, job  # noqa: E402
from orchestrator.cli import main as cli_main  # noqa: E402

mounted = {group.name for group in cli_main.app.registered_groups}
if "job" not in mounted:
    cli_main.app.add_typer(job.app, name="job")
if "backends" not in mounted:
    cli_main.app.add_typer(backends.app, name="backends")

if __name__ == "__main__":
    cli_main.main()
