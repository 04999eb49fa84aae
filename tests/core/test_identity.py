"""Canonical configs and stage identity: what must and must not change a cache key."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.hashing import canonical_json, hash_json
from orchestrator.identity import compute_identity, diff_identities

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
configs = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


def _reorder(value):
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reorder(v) for v in value]
    return value


@given(st.dictionaries(st.text(max_size=6), configs, max_size=6))
def test_key_order_never_matters(config: dict) -> None:
    assert canonical_json(config) == canonical_json(_reorder(config))


@given(st.integers(min_value=-(2**53), max_value=2**53))
def test_int_and_integral_float_are_the_same_config(n: int) -> None:
    assert hash_json({"lr": n}) == hash_json({"lr": float(n)})


@given(st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()))
def test_fractional_floats_are_kept_exactly(x: float) -> None:
    assert hash_json({"lr": x}) != hash_json({"lr": x + abs(x) * 1e-9 + 1e-300}) or x + abs(x) * 1e-9 + 1e-300 == x


@given(st.text(max_size=12))
def test_unicode_normal_form_never_matters(text: str) -> None:
    nfd = unicodedata.normalize("NFD", text)
    nfc = unicodedata.normalize("NFC", text)
    assert hash_json({nfd: nfd}) == hash_json({nfc: nfc})


def test_distinct_values_hash_differently() -> None:
    assert hash_json({"a": 1}) != hash_json({"a": "1"})
    assert hash_json({"a": True}) != hash_json({"a": 1})
    assert hash_json([1, 2]) != hash_json([2, 1])


def test_non_finite_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        canonical_json({"x": float("nan")})


def _ident(**over):
    base = dict(
        stage="pretrain",
        config={"steps": 100, "lr": 3e-4},
        inputs={"tokens": "t" * 64},
        code={"workloads/moe/train.py": "c" * 40},
        environment={"packages_hash": "p" * 64},
    )
    base.update(over)
    stage = base.pop("stage")
    config = base.pop("config")
    return compute_identity(stage, config, **base)


def test_identity_depends_on_content_not_on_upstream_runs() -> None:
    # Two upstream runs that produced byte-identical output give the same input hash.
    assert _ident().digest == _ident(inputs={"tokens": "t" * 64}).digest
    assert _ident().digest != _ident(inputs={"tokens": "u" * 64}).digest


@pytest.mark.parametrize("key", ["host", "backend", "output_prefix", "region", "time"])
def test_where_a_job_runs_never_enters_the_identity(key: str) -> None:
    with pytest.raises(ValueError, match="placement keys"):
        _ident(config={"steps": 100, key: "x"})


def test_diff_names_each_changed_field() -> None:
    a = _ident()
    b = _ident(config={"steps": 200, "lr": 3e-4}, code={"workloads/moe/train.py": "d" * 40})
    changes = {c.path: (c.old, c.new) for c in diff_identities(a, b)}
    assert changes == {
        "config.steps": (100, 200),
        "code.workloads/moe/train.py": ("c" * 40, "d" * 40),
    }
    assert diff_identities(a, a.fields()) == []
    added = diff_identities(a, _ident(inputs={"tokens": "t" * 64, "extra": "e"}))
    assert [(c.path, c.old, c.new) for c in added] == [("inputs.extra", None, "e")]
    assert "added" in added[0].describe()
