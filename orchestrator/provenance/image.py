"""Which code a job image holds, and whether it is the code a run records.

Where a job runs the code *inside* its image (Kubernetes; Docker with ``mount_workdir =
false``), the run's recorded commit and tree say nothing about what ran unless the image
was built from that tree. ``infra/docker/build-job-image.sh`` therefore labels the image
with the git ids of the paths it copies in (:data:`CODE_LABEL`, a JSON object such as
``{"orchestrator": "<tree id>", "workloads": "<tree id>", "pyproject.toml": "<blob id>"}``),
computed from the working tree as :func:`orchestrator.provenance.git.path_hashes` computes
them, so uncommitted edits count. :func:`check_image_code` compares that label with the
run's tree before anything is recorded.

The label holds tree ids, not the commit: a documentation-only commit leaves the image (and
so every container stage's identity) unchanged, while any edit to the copied code changes it.

``[backends.<name>] image_code_check``: ``"require"`` (default) refuses a run whose image
holds other code, carries no label, or cannot be inspected; ``"warn"`` logs the same finding
and runs, recording it; ``"off"`` skips the check (recorded as such).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError

log = logging.getLogger(__name__)

#: Image label holding the git ids of the code paths the image was built from.
CODE_LABEL = "openlab.io/code"
CHECK_MODES = ("require", "warn", "off")


class ImageCodeMismatch(ConfigError):
    """The job image does not hold the code of the tree the run records."""


def image_code(labels: Mapping[str, str] | None) -> dict[str, str] | None:
    """The ``{path: git id}`` an image's labels declare, or None when there is no usable label."""
    raw = (labels or {}).get(CODE_LABEL)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not value or not all(isinstance(v, str) for v in value.values()):
        return None
    return {str(k): v for k, v in value.items()}


def _finding(image: str, labels: Mapping[str, str] | None, repo_root: Path) -> tuple[str | None, dict[str, Any]]:
    """(problem or None, record) for ``image`` against the tree at ``repo_root``."""
    from orchestrator.provenance.git import ProvenanceError, path_hashes

    if labels is None:
        return (
            f"cannot read the labels of job image {image} (no local Docker engine holds it; `docker pull` it here)",
            {"image": image, "verified": False, "reason": "labels unreadable"},
        )
    declared = image_code(labels)
    if declared is None:
        return (
            f"job image {image} has no {CODE_LABEL} label, so which code it holds is unknown "
            "(build it with infra/docker/build-job-image.sh)",
            {"image": image, "verified": False, "reason": "no code label"},
        )
    try:
        tree = path_hashes(repo_root, sorted(declared))
    except ProvenanceError as exc:
        return f"cannot compare job image {image} with this run: {exc}", {
            "image": image,
            "code": declared,
            "verified": False,
            "reason": "no git tree",
        }
    differ = [p for p in sorted(declared) if tree.get(p) != declared[p]]
    record: dict[str, Any] = {"image": image, "code": declared, "verified": not differ}
    if not differ:
        return None, record
    shown = ", ".join(f"{p} (image {declared[p][:10]}, tree {(tree.get(p) or 'absent')[:10]})" for p in differ)
    record["reason"] = f"differs: {', '.join(differ)}"
    return (
        f"job image {image} was built from other code than this run's tree: {shown}; rebuild it from this tree "
        "(infra/docker/build-job-image.sh) and run again",
        record,
    )


def check_image_code(
    backend: str, image: str, labels: Mapping[str, str] | None, repo_root: Path, mode: str = "require"
) -> dict[str, Any]:
    """Check that ``image`` holds the code of ``repo_root``'s working tree; the outcome, for lineage.

    Raises :class:`ImageCodeMismatch` (one line, with the way out) when ``mode`` is
    ``"require"`` and the image holds other code, has no label, or cannot be inspected.
    """
    if mode not in CHECK_MODES:
        raise ConfigError(f"[backends.{backend}] image_code_check = {mode!r}: use one of {', '.join(CHECK_MODES)}")
    if mode == "off":
        return {"image": image, "verified": False, "reason": "check off"}
    problem, record = _finding(image, labels, repo_root)
    if problem is None:
        return record
    way_out = f'[backends.{backend}] image_code_check = "warn" runs it anyway, recording this'
    if mode == "require":
        raise ImageCodeMismatch(f"{backend}: {problem}; or {way_out}")
    log.warning("%s: %s (image_code_check = warn: running anyway)", backend, problem)
    return record
