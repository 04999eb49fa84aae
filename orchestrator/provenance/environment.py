"""Environment provenance: which interpreter, packages, machine and container ran a stage.

Captured once per process (the answer does not change while it runs) and cheap:
no torch import, no network. Environment variables' *values* are never recorded,
because they routinely hold secrets; the single exception is
``OPENLAB_IMAGE_DIGEST``, set by openlab's own launcher, and only when it has the
shape of an image digest.

``id`` identifies the environment as recorded: Python version and implementation, OS and
architecture, libc, the installed-distributions hash and the image digest, and the machine
(host, CPU, GPU). Left out of it, a run on a GPU node was linked to the record of the first run
of the same software, on a laptop, and lineage said the wrong host and hardware. Stage identity
never uses this id: a stage declares the fields its result depends on (``packages_hash``, the
image digest, a hardware field where numerics depend on it), so where a job ran does not
change what it means.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.hashing import hash_bytes, hash_json

_DIGEST = re.compile(r"^(?:[\w./:-]+@)?sha256:[0-9a-f]{64}$")
_CONTAINER_MARKERS = ("docker", "kubepods", "containerd", "libpod", "lxc")


@dataclass(frozen=True)
class EnvironmentInfo:
    """What the process runs on; ``to_dict()`` is part of ``openlab provenance --json``."""

    id: str
    python_version: str
    python_implementation: str
    platform: str
    system: str
    machine: str
    libc: str
    hostname: str
    cpu_model: str | None
    cpu_count: int
    gpu_models: tuple[str, ...]
    packages_hash: str
    packages_count: int
    in_container: bool
    container_image_digest: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "python_version": self.python_version,
            "python_implementation": self.python_implementation,
            "platform": self.platform,
            "system": self.system,
            "machine": self.machine,
            "libc": self.libc,
            "hostname": self.hostname,
            "cpu_model": self.cpu_model,
            "cpu_count": self.cpu_count,
            "gpu_models": list(self.gpu_models),
            "packages_hash": self.packages_hash,
            "packages_count": self.packages_count,
            "in_container": self.in_container,
            "container_image_digest": self.container_image_digest,
        }


def normalise_dist_name(name: str) -> str:
    """PEP 503 normalisation, so ``Foo_Bar`` and ``foo-bar`` hash the same."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_packages() -> list[str]:
    """Sorted, de-duplicated ``name==version`` for every importable distribution."""
    seen: set[str] = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if not name:
            continue
        seen.add(f"{normalise_dist_name(name)}=={dist.version}")
    return sorted(seen)


@functools.lru_cache(maxsize=1)
def _packages() -> tuple[str, ...]:
    """:func:`installed_packages` once per process (0.3 s each time), as the environment is captured."""
    return tuple(installed_packages())


def packages_hash(packages: list[str] | None = None) -> str:
    """BLAKE3 over the sorted ``name==version`` lines joined by ``\\n``."""
    lines = installed_packages() if packages is None else sorted(set(packages))
    return hash_bytes("\n".join(lines).encode("utf-8"))


def cpu_model() -> str | None:
    """CPU model name from /proc/cpuinfo, else :func:`platform.processor`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def gpu_models(timeout: float = 5.0) -> tuple[str, ...]:
    """Names of the NVIDIA GPUs visible to this process, empty when none.

    Order of preference: ``nvidia-smi`` (the node's GPUs), ``/proc/driver/nvidia``,
    then torch only if the program has already imported it (importing torch just to
    ask would cost seconds).
    """
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            names = tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and names:
                return names
        except (OSError, subprocess.SubprocessError):
            pass
    names_list: list[str] = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            for line in Path(info).read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    names_list.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    if names_list:
        return tuple(names_list)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        except Exception:  # noqa: BLE001 - a broken CUDA setup must not break provenance
            pass
    return ()


def container_info() -> tuple[bool, str | None]:
    """(running in a container?, image digest if the launcher told us)."""
    digest = os.environ.get("OPENLAB_IMAGE_DIGEST", "").strip()
    if digest and _DIGEST.match(digest):
        return True, digest
    markers = Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()
    if not markers:
        try:
            cgroup = Path("/proc/1/cgroup").read_text(errors="replace")
            markers = any(m in cgroup for m in _CONTAINER_MARKERS)
        except OSError:
            pass
    return markers, None


def _identity(info: dict[str, Any]) -> str:
    keys = (
        "python_version",
        "python_implementation",
        "system",
        "machine",
        "libc",
        "packages_hash",
        "container_image_digest",
        "hostname",
        "cpu_model",
        "gpu_models",
    )
    return hash_json({k: info[k] for k in keys})


@functools.lru_cache(maxsize=1)
def _capture() -> EnvironmentInfo:
    packages = list(_packages())
    in_container, digest = container_info()
    libc_name, libc_version = platform.libc_ver()
    fields: dict[str, Any] = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "system": platform.system(),
        "machine": platform.machine(),
        "libc": f"{libc_name} {libc_version}".strip(),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "gpu_models": gpu_models(),
        "packages_hash": packages_hash(packages),
        "packages_count": len(packages),
        "in_container": in_container,
        "container_image_digest": digest,
    }
    return EnvironmentInfo(id=_identity(fields), **fields)


def keep_packages(blobs_dir: Path) -> Path:
    """Store this process's ``name==version`` list in the blob store under its hash (the environment's
    ``packages_hash``) and return where: the hash alone says that two environments differ, the list
    says how, and lets a later reader install the same (``pip install -r`` it)."""
    from orchestrator.snapshots import atomic_write

    text = "\n".join(_packages()).encode("utf-8")
    blob = blobs_dir / hash_bytes(text)
    if not blob.exists():
        atomic_write(blob, text)
    return blob


def capture_environment(*, refresh: bool = False) -> EnvironmentInfo:
    """Describe this process's environment; cached for the life of the process.

    ``refresh=True`` recomputes (after installing a package in-process, say).
    """
    if refresh:
        _packages.cache_clear()
        _capture.cache_clear()
    return _capture()
