"""Job launchers: run a stage's command locally, in Docker, on Slurm or on Kubernetes.

See :mod:`orchestrator.launchers.base` for the interface and
:mod:`orchestrator.launchers.attempts` for how each submission is recorded in lineage.
"""

from orchestrator.launchers.base import (
    BACKENDS,
    BackendUnavailable,
    Backoff,
    ImageNotFound,
    JobHandle,
    JobNotFound,
    JobSpec,
    JobState,
    JobStatus,
    JobTimeout,
    Launcher,
    LauncherError,
    OtherCluster,
    configured_backends,
    get_launcher,
    parse_duration,
    parse_memory,
)

__all__ = [
    "BACKENDS",
    "Backoff",
    "BackendUnavailable",
    "ImageNotFound",
    "JobHandle",
    "JobNotFound",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobTimeout",
    "Launcher",
    "LauncherError",
    "OtherCluster",
    "configured_backends",
    "get_launcher",
    "parse_duration",
    "parse_memory",
]
