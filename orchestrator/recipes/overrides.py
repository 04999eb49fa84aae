"""Values given beside a recipe rather than in it: ``--set``, a sweep's ``--grid`` and ``--sample``.

Each is read from the command line or the UI's form the same way (a value as YAML, so
``--set pretrain.lr=1e-4`` is a number), and written back as one word (:func:`set_words`) for a
run's name, its card and its summary. Whether a key is a recipe field and a value fits it is
:func:`orchestrator.recipes.resolve`'s to say, per run, before any starts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator.errors import ConfigError, choices
from orchestrator.recipes.schema import load_yaml


def set_value_word(value: Any) -> str:
    """A set value as one word :func:`parse_sets` reads back: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def set_words(sets: Mapping[str, Any]) -> list[str]:
    """``pretrain.lr=0.02``, ``pretrain.mixture={"code": 0.5}``: each set value as one word that
    :func:`parse_sets` reads back (for a run's name, its card and its summary)."""
    return [f"{k}={set_value_word(v)}" for k, v in sets.items()]


#: The most runs one sweep may start: a grid typed with one value too many per key multiplies.
MAX_TRIALS = 64


def sweep_trials(
    grid: Mapping[str, Any], fixed: Mapping[str, Any] | None = None, sampling: Sampling | None = None
) -> list[dict[str, Any]]:
    """The values of each run of a sweep: every combination of ``grid``'s lists (the first key
    varying slowest), each crossed with every draw of ``sampling`` (when given), each over the
    values ``fixed`` for all of them. Whether each key is a recipe field and each value fits it
    is :func:`resolve`'s to say, per run, before any starts."""
    if not isinstance(grid, Mapping) or (not grid and sampling is None):
        raise ConfigError('sweep: give a grid of values to try, e.g. {"pretrain.lr": [0.005, 0.01, 0.02]}')
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep: {key}: give a list of the values to try, e.g. [0.005, 0.01], got {values!r}")
        if key in (fixed or {}):
            raise ConfigError(f"sweep: {key} is both swept and set for every run: keep one")
        for i, value in enumerate(values):
            if value in values[:i]:  # a typo, not a repeat: two identical runs would reuse one result
                raise ConfigError(f"sweep: {key}: the value {value!r} is given twice; give each value once")
    for key in sampling.samplers if sampling is not None else ():
        if key in grid or key in (fixed or {}):
            raise ConfigError(f"sweep: {key} is both sampled and {'swept' if key in grid else 'set for every run'}")
    count = math.prod(len(v) for v in grid.values()) * (sampling.count if sampling is not None else 1)
    if count > MAX_TRIALS:
        what = "the product of the grid's lists" + (" and --count" if sampling is not None else "")
        raise ConfigError(f"sweep: {count} runs ({what}), more than {MAX_TRIALS}: trim it")
    trials: list[dict[str, Any]] = [{}]
    for key, values in grid.items():
        trials = [{**trial, key: value} for trial in trials for value in values]
    if sampling is not None:
        points = sampling.points()
        trials = [{**trial, **point} for trial in trials for point in points]
    return [{**(fixed or {}), **trial} for trial in trials]


def split_item(item: str, option: str, form: str) -> tuple[str, str]:
    """``KEY=TEXT`` of a ``--set`` / ``--grid`` / ``--sample`` argument as (key, text), or the one-line
    error that shows ``form`` (``KEY=VALUE with a dotted recipe key, e.g. pretrain.lr=0.02``)."""
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key or not text.strip():
        raise ConfigError(f"{option} {item!r}: expected {form}")
    return key, text


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` arguments as a mapping (a later one of a key wins, as in a shell).

    The value is read as YAML, as in a recipe: ``0.02`` is a number, ``true`` a bool,
    ``[a, b]`` a list, ``{code: 0.5, prose: 0.5}`` a mapping, ``null`` none, anything else text.
    Whether the key is a recipe field and the value fits it is checked by :func:`resolve`.
    """
    sets: dict[str, Any] = {}
    for item in items:
        key, raw = split_item(item, "--set", "KEY=VALUE with a dotted recipe key, e.g. pretrain.lr=0.02")
        try:
            sets[key] = load_yaml(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot read the value {raw!r}: {' '.join(str(exc).split())}") from None
    return sets


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``--grid KEY=V1,V2,...`` arguments as a sweep's grid (key -> the values to try, in order).

    The values are a YAML list, its brackets optional, as Hydra's multirun takes them:
    ``pretrain.lr=0.005,0.01,0.02`` and ``pretrain.lr='[0.005, 0.01, 0.02]'`` are the same three
    numbers, ``dispatch.scheme=ragged,waterfilling`` two words, and
    ``pretrain.mixture='{code: 0.5, prose: 0.5},{code: 0.7, prose: 0.3}'`` two mappings. A key given
    twice is refused rather than one silently dropping the other's values.
    """
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, raw = split_item(item, "--grid", "KEY=V1,V2,... with a dotted recipe key, e.g. pretrain.lr=0.01,0.02")
        text = raw.strip()
        if key in grid:
            raise ConfigError(f"--grid {key} is given twice: put all its values in one, e.g. {key}=V1,V2,V3")
        try:
            values = load_yaml(text if text.startswith("[") else f"[{text}]")
        except yaml.YAMLError as exc:
            raise ConfigError(f"--grid {key}: cannot read the values {text!r}: {' '.join(str(exc).split())}") from None
        if not isinstance(values, list) or not values:
            raise ConfigError(f"--grid {key}: give the values to try, e.g. {key}=V1,V2 (got {text!r})")
        grid[key] = values
    return grid


#: How a sampled value is drawn: ``--sample KEY=DIST`` (``openlab sweep``), ``samples`` in the UI's form.
SAMPLERS = ("uniform", "loguniform", "int", "choice")


@dataclass(frozen=True)
class Sampler:
    """One ``--sample`` distribution: ``uniform(A, B)``, ``loguniform(A, B)`` (A > 0: learning
    rates, spread evenly over their orders of magnitude), ``int(A, B)`` (both ends included) or
    ``choice(V1, V2, ...)``. A drawn float keeps 4 significant digits: what a person reads in the
    sweep's table is the value the run was given, and the value its identity hashes."""

    kind: str
    args: tuple[Any, ...]

    @property
    def text(self) -> str:
        """As typed, canonically (recorded with the sweep, so it can be drawn again)."""
        return f"{self.kind}({', '.join(set_value_word(a) for a in self.args)})"

    def draw(self, rng: random.Random) -> Any:
        if self.kind == "choice":
            return rng.choice(self.args)
        low, high = self.args
        if self.kind == "int":
            return rng.randint(low, high)
        value = (
            math.exp(rng.uniform(math.log(low), math.log(high)))
            if self.kind == "loguniform"
            else rng.uniform(low, high)
        )
        return float(f"{value:.4g}")


def parse_sample(key: str, text: str, option: str = "--sample") -> Sampler:
    """``loguniform(0.001, 0.03)`` as a :class:`Sampler`, or a one-line error naming ``key`` as
    given with ``option`` (``samples`` in the UI's form)."""
    name, paren, rest = str(text).strip().partition("(")
    name = name.strip()
    example = "e.g. pretrain.lr=loguniform(0.001,0.03), seed=int(0,99) or dispatch.scheme=choice(ragged,waterfilling)"
    if not paren or not rest.rstrip().endswith(")"):
        raise ConfigError(f"{option} {key}: cannot read {text!r} as a distribution; {example}")
    if name not in SAMPLERS:
        raise ConfigError(f"{option} {key}: {choices(name, SAMPLERS, label='distributions')}")
    try:
        args = load_yaml(f"[{rest.rstrip()[:-1]}]")
    except yaml.YAMLError:
        raise ConfigError(f"{option} {key}: cannot read the values of {text!r}; {example}") from None
    if name == "choice":
        if not args:
            raise ConfigError(f"{option} {key}: choice() needs the values to choose from; {example}")
        return Sampler(name, tuple(args))
    numeric = int if name == "int" else (int, float)
    if len(args) != 2 or not all(isinstance(a, numeric) and not isinstance(a, bool) for a in args):
        want = "two whole numbers" if name == "int" else "two numbers"
        raise ConfigError(f"{option} {key}: {name}() takes {want}, the lowest and the highest, got {text!r}")
    low, high = args
    if not low < high:
        raise ConfigError(f"{option} {key}: {name}({low}, {high}): the lowest must be below the highest")
    if name == "loguniform" and low <= 0:
        raise ConfigError(f"{option} {key}: loguniform({low}, {high}): both ends must be above 0")
    return Sampler(name, (low, high))


def parse_samples(items: Sequence[str]) -> dict[str, Sampler]:
    """``--sample KEY=DIST`` arguments (a key given twice is refused, as in :func:`parse_grid`)."""
    samples: dict[str, Sampler] = {}
    for item in items:
        key, text = split_item(item, "--sample", "KEY=DIST, e.g. pretrain.lr=loguniform(0.001,0.03)")
        if key in samples:
            raise ConfigError(f"--sample {key} is given twice: one distribution a key")
        samples[key] = parse_sample(key, text)
    return samples


@dataclass(frozen=True)
class Sampling:
    """A sweep's random part: ``count`` different draws of the ``samplers``' values, the same for
    a given ``seed`` (a sweep drawn again draws the same values, so its runs are reused; another
    seed draws others). Crossed with the grid: every grid combination runs every draw, so grid
    values are compared on the same sampled points."""

    samplers: dict[str, Sampler]
    count: int
    seed: int = 0

    @classmethod
    def asked(
        cls,
        samplers: Mapping[str, Sampler] | None,
        count: int | None,
        seed: int = 0,
        named: tuple[str, str] = ("--sample", "--count"),
    ) -> Sampling | None:
        """The sampling a sweep was asked for (None: none); distributions without a count, or a count
        without distributions, are refused naming the two as given (``samples``, ``count`` in the form)."""
        if not samplers and not count:
            return None
        if not samplers or count is None or count < 1:
            raise ConfigError(
                f"{named[0]} and {named[1]} go together: each {named[0]} key is drawn {named[1]} times (1 or more)"
            )
        return cls(dict(samplers), count, seed)

    def points(self) -> list[dict[str, Any]]:
        """The draws, in order; refused when the distributions hold fewer different points than asked."""
        if self.count < 1:
            raise ConfigError(f"sweep: --count {self.count}: how many draws of the sampled values to run, 1 or more")
        if self.count > MAX_TRIALS:
            raise ConfigError(f"sweep: --count {self.count}: more than {MAX_TRIALS} runs; trim it")
        rng = random.Random(self.seed)
        points: list[dict[str, Any]] = []
        for _ in range(100 * self.count):
            point = {key: sampler.draw(rng) for key, sampler in self.samplers.items()}
            if point not in points:
                points.append(point)
                if len(points) == self.count:
                    return points
        raise ConfigError(
            f"sweep: --count {self.count} different draws asked, but the distributions gave only {len(points)}: "
            "lower --count"
        )

    def to_dict(self) -> dict[str, Any]:
        """As a sweep's runs record it (``params.sweep.sampled``): enough to draw the same values again."""
        return {"samples": {k: v.text for k, v in self.samplers.items()}, "count": self.count, "seed": self.seed}
