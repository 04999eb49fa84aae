"""Stage identity: the cache key that says whether a stage's result can be reused.

A stage's identity is a hash of *what* it computes, never of *where* or *when*:

- ``stage``: its name;
- ``config``: its canonical config (key order, ``1`` vs ``1.0`` and Unicode form do not
  matter; see :func:`orchestrator.hashing.canonical`);
- ``inputs``: for each input, the **content** hash of the upstream output or the data
  snapshot id — not the upstream stage's identity — so an upstream re-run that
  produces byte-identical output leaves everything downstream valid (Marin #4204);
- ``code``: for each path the stage declares as its code, the git tree hash of that
  path *in the working tree*, so an uncommitted edit to that path changes it and an
  edit anywhere else does not;
- ``environment``: only the environment fields the stage declares (e.g. the
  packages hash, or the image digest).

Host, backend, output prefix, region and time never enter it (Marin #5216): a
failover to another cluster must find the same results. :func:`diff_identities`
names every field that differs between two identities (Marin #2219).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.hashing import canonical, hash_json

#: Bumped when the meaning of the identity fields changes.
IDENTITY_VERSION = 1

#: Config keys that describe where or when a job runs; they must not reach the identity.
LOCATION_KEYS = frozenset(
    {
        "host",
        "hostname",
        "backend",
        "out",
        "out_dir",
        "output_dir",
        "output_prefix",
        "prefix",
        "region",
        "time",
        "timestamp",
        "started_at",
        "node",
        "cluster",
    }
)


@dataclass(frozen=True)
class StageIdentity:
    """Everything that decides a stage's result, and its hash."""

    stage: str
    config: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, str] = field(default_factory=dict)
    code: Mapping[str, str] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The identity as a canonical dict; this is what is hashed and stored."""
        return canonical(
            {
                "version": IDENTITY_VERSION,
                "stage": self.stage,
                "config": dict(self.config),
                "inputs": dict(self.inputs),
                "code": dict(self.code),
                "environment": dict(self.environment),
            }
        )

    @property
    def digest(self) -> str:
        """The stage identity: BLAKE3 of the canonical fields."""
        return hash_json(self.fields())


def compute_identity(
    stage: str,
    config: Mapping[str, Any],
    *,
    inputs: Mapping[str, str] | None = None,
    code: Mapping[str, str] | None = None,
    environment: Mapping[str, str] | None = None,
) -> StageIdentity:
    """Build a stage identity, refusing config keys that say where or when a job runs."""
    leaked = sorted(LOCATION_KEYS.intersection(config))
    if leaked:
        raise ValueError(
            f"stage {stage!r} config carries placement keys {leaked}: where or when a job runs "
            "must not change its identity; pass them to the launcher instead"
        )
    return StageIdentity(
        stage=stage,
        config=dict(config),
        inputs=dict(inputs or {}),
        code=dict(code or {}),
        environment=dict(environment or {}),
    )


@dataclass(frozen=True)
class FieldChange:
    """One identity field that differs: its dotted path and both values (None = absent)."""

    path: str
    old: Any
    new: Any

    def describe(self) -> str:
        if self.old is None:
            return f"{self.path}: added ({_short(self.new)})"
        if self.new is None:
            return f"{self.path}: removed (was {_short(self.old)})"
        return f"{self.path}: {_short(self.old)} -> {_short(self.new)}"


def source_file(path: str) -> str | None:
    """The source file an identity field is the tree hash of (``code.workloads/moe/train.py``:
    ``workloads/moe/train.py``), None for any other field: what a diff, a dry run and a nightly's
    verdict name, and look up the commits of, when a stage's code changed."""
    return path.removeprefix("code.") if str(path).startswith("code.") else None


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 24 or not isinstance(value, str) else f"{text[:12]}…"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key in sorted(value):
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def diff_identities(
    old: StageIdentity | Mapping[str, Any], new: StageIdentity | Mapping[str, Any]
) -> list[FieldChange]:
    """Every field that differs between two identities (or their stored ``fields()``)."""
    a = _flatten(old.fields() if isinstance(old, StageIdentity) else canonical(dict(old)))
    b = _flatten(new.fields() if isinstance(new, StageIdentity) else canonical(dict(new)))
    return [
        FieldChange(path, a.get(path), b.get(path))
        for path in sorted(a.keys() | b.keys())
        if a.get(path) != b.get(path)
    ]
