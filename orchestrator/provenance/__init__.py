"""Provenance capture: the code (git) and the environment a stage runs with.

:func:`capture` is what ``openlab provenance [PATH]`` prints: its ``to_dict()`` has
``git.commit``, ``git.dirty``, ``git.patch_hash`` (null when clean) and
``environment.packages_hash``. Pure library code: it returns typed results and
writes only the content-addressed dirty patch; the lineage store records them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.provenance.environment import EnvironmentInfo, capture_environment, keep_packages
from orchestrator.provenance.git import (
    GitInfo,
    ProvenanceError,
    ProvenanceWarning,
    SubmoduleInfo,
    capture_git,
    commit_exists,
    strip_credentials,
)
from orchestrator.settings import Settings, load_settings

__all__ = [
    "EnvironmentInfo",
    "GitInfo",
    "Provenance",
    "ProvenanceError",
    "ProvenanceWarning",
    "SubmoduleInfo",
    "capture",
    "capture_environment",
    "capture_git",
    "commit_exists",
    "strip_credentials",
]


@dataclass(frozen=True)
class Provenance:
    """Git and environment facts captured together."""

    git: GitInfo
    environment: EnvironmentInfo

    def to_dict(self) -> dict[str, Any]:
        return {"git": self.git.to_dict(), "environment": self.environment.to_dict()}


def capture(
    path: Path = Path("."),
    code_paths: Sequence[str] = (),
    *,
    settings: Settings | None = None,
    keep_patch: bool = True,
) -> Provenance:
    """Capture provenance for the repository containing ``path`` and this process (``keep_patch``:
    see :func:`capture_git`)."""
    git = capture_git(path, code_paths=code_paths, settings=settings, keep_patch=keep_patch)
    if keep_patch:  # the package list beside the patch: what the environment's hash stands for
        keep_packages((settings if settings is not None else load_settings()).blobs_dir)
    return Provenance(git=git, environment=capture_environment())
