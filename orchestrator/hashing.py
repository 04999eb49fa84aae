"""Canonical serialisation and content hashing shared by every part of openlab.

Identities, event hashes and snapshot ids must not depend on dict key order, on
whether a number was written ``1`` or ``1.0``, or on the Unicode normal form of a
string: two configs that mean the same must hash the same, forever. That is why
everything hashed goes through :func:`canonical_json` first.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import math
import unicodedata
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import blake3

HASH_NAME = "blake3"


def _normalise(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"cannot canonicalise non-finite number {value!r}")
        # 1.0 and 1 mean the same in a config; keep one spelling.
        if value.is_integer() and abs(value) < 2**63:
            return int(value)
        return value
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, enum.Enum):
        return _normalise(value.value)
    if isinstance(value, PurePath):
        return unicodedata.normalize("NFC", value.as_posix())
    if isinstance(value, _dt.datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"config keys must be strings, got {key!r}")
            out[unicodedata.normalize("NFC", key)] = _normalise(item)
        return out
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_normalise(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    raise TypeError(f"cannot canonicalise value of type {type(value).__name__}")


def canonical(value: Any) -> Any:
    """Return ``value`` normalised: NFC strings, integral floats as ints, tuples as lists."""
    return _normalise(value)


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` to canonical JSON bytes (sorted keys, no whitespace, UTF-8)."""
    return json.dumps(
        _normalise(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def hash_bytes(data: bytes) -> str:
    """BLAKE3 hex digest of ``data``."""
    return blake3.blake3(data).hexdigest()


def hash_json(value: Any) -> str:
    """BLAKE3 hex digest of the canonical JSON of ``value``."""
    return hash_bytes(canonical_json(value))


def hash_file(path: str | PurePath, *, chunk: int = 1 << 20) -> str:
    """BLAKE3 hex digest of a file's content, streamed."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            hasher.update(block)
    return hasher.hexdigest()
