"""Shared output helpers: JSON for scripts, rich tables for people, one-line errors."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """Print one JSON document on stdout (no colour, no wrapping: scripts parse it)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = 2) -> None:
    """Print one clear error line on stderr and exit with ``code``."""
    import typer

    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
