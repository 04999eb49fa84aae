"""Recipes: a full-scale training run described as data, and replicas derived from it.

A recipe file (``recipes/*.yaml``) holds the *reference* run at full scale — model shape,
routing and dispatch, data, token budget and its pretrain / mid-train split, post-train,
eval, hardware, W&B project and the metrics the nightly verdict tracks — plus named
``replicas``. A replica is the reference recipe times explicit scale factors
(``scale: {d_model: 1/96, ...}``, each factor applied by a fixed rule in
:data:`SCALE_RULES`), plus explicit ``set`` values for what has no scaling rule, plus
``runtime`` settings (device, threads) that say where it runs and so never reach a stage
identity. Why so explicit: a replica's numbers must be explainable from the reference
alone, and its lineage records the reference recipe and every factor.

:func:`load_recipe` reads a file with :func:`load_yaml` (safe YAML; ``1e-4`` a number) and validates it against
:data:`RECIPE_SCHEMA`; unknown keys and wrong types raise :class:`ConfigError` naming the
key path (``recipe marin-535b-a23b.yaml: model.experts: expected int, got str``).
:func:`resolve` turns a recipe and a replica name into concrete per-stage configs in the
MoE workload's config schema (:mod:`workloads.moe.config`), validated by the workload's
own checks before any job starts.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import ConfigError, OpenlabError, choices
from orchestrator.hashing import hash_json
from orchestrator.launchers.base import BACKENDS, parse_memory
from orchestrator.preregistration import Prediction
from orchestrator.tolerances import check_metric, parse_tolerances

#: Where recipe names (``marin-535b-a23b``) are looked up: ``recipes/`` at the repo root.
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

#: The workload stages a recipe can resolve to, in pipeline order (a replica picks some with
#: ``stages``; the default is the training chain without ``repro``).
STAGES = ("data", "tokenize", "pretrain", "midtrain", "posttrain", "eval", "repro")
DEFAULT_STAGES = STAGES[:-1]
#: The stages that may run as several tasks of one job (data-parallel training: workloads/moe/distributed.py);
#: the workload states the same list (``workloads.moe.__main__``), kept equal by a test.
TRAINING_STAGES = ("pretrain", "midtrain", "posttrain")

#: Config keys that say where a stage runs; they go into stage configs but never into identities.
RUNTIME_KEYS = ("device", "threads")


class _Number:
    """Schema marker: an int or a float (never a bool)."""


class _Ratio:
    """Schema marker: a positive scale factor, written ``0.25`` or ``"1/4"``."""


@dataclass(frozen=True)
class Opt:
    """Schema marker: the key may be absent (and, for ``nullable``, null)."""

    spec: Any
    nullable: bool = False


@dataclass(frozen=True)
class MapOf:
    """Schema marker: a mapping from free-form string keys to values of ``spec``."""

    spec: Any


@dataclass(frozen=True)
class ListOf:
    """Schema marker: a list whose items are each ``spec``."""

    spec: Any


@dataclass(frozen=True)
class OneOf:
    """Schema marker: one of a fixed set of strings."""

    choices: tuple[str, ...]


NUMBER = _Number()
RATIO = _Ratio()

_TRAIN = {
    "lr": NUMBER,
    "min_lr_ratio": NUMBER,
    "warmup_fraction": NUMBER,
    "weight_decay": NUMBER,
    "grad_clip": NUMBER,
    "mixture": Opt(MapOf(NUMBER)),
    "checkpoint_every": int,
    #: Keep every N-th step's checkpoint as an immutable revision (the workload's train.keep_every).
    "keep_every": Opt(int),
}

#: Where a stage's Slurm job goes (``#SBATCH --partition`` ...), per stage: data prep on a CPU
#: partition, training on a GPU one. Over ``[backends.slurm]``; used only when the run is on Slurm.
_SLURM_STAGE_OPTIONS = {
    "partition": Opt(str),
    "account": Opt(str),
    "qos": Opt(str),
    "constraint": Opt(str),
    "nodelist": Opt(str),
    "extra_args": Opt(ListOf(str)),
}

#: Where a stage's pod goes on Kubernetes, per stage: training on the GPU node pool (its selector,
#: the pool's taint tolerated), at a priority class that may preempt other pods. Over
#: ``[backends.kubernetes]``; used only when the stage runs on Kubernetes. Tolerations are written
#: as Kubernetes writes them.
_KUBERNETES_STAGE_OPTIONS = {
    "namespace": Opt(str),
    "node_selector": Opt(MapOf(str)),
    "tolerations": Opt(
        ListOf(
            {
                "key": Opt(str),
                "operator": Opt(OneOf(("Exists", "Equal"))),
                "value": Opt(str),
                "effect": Opt(OneOf(("NoSchedule", "PreferNoSchedule", "NoExecute"))),
                "tolerationSeconds": Opt(int),
            }
        )
    ),
    "priority_class": Opt(str),
    "service_account": Opt(str),
}

#: A stage's container on Docker: a bigger /dev/shm for DataLoader workers, a dataset mounted
#: read-only (``{/data/corpus: "/data/corpus:ro"}``), a network for a stage that fetches, a user.
#: Over ``[backends.docker]``; used only when the stage runs on Docker.
_DOCKER_STAGE_OPTIONS = {
    "shm_size": Opt(str),
    "mounts": Opt(MapOf(str)),
    "network_mode": Opt(str),
    "user": Opt(str),
}

#: The backends a stage may carry options for (``resources.<stage>.<backend>``).
BACKEND_OPTIONS = ("slurm", "kubernetes", "docker")

#: What a stage's job asks its backend for (JobSpec's fields); never part of a stage's identity.
_RESOURCES = {
    "cpus": Opt(NUMBER),
    "memory": Opt(str),
    "gpus": Opt(int),
    "time_limit": Opt(int),
    # A training stage as several processes of one job (data parallel; Slurm: srun tasks).
    "nodes": Opt(int),
    "tasks_per_node": Opt(int),
    "slurm": Opt(_SLURM_STAGE_OPTIONS),
    "kubernetes": Opt(_KUBERNETES_STAGE_OPTIONS),
    "docker": Opt(_DOCKER_STAGE_OPTIONS),
    # Where the stage's job runs, over the run's backend (data prep here, training on the cluster).
    "backend": Opt(OneOf(tuple(BACKENDS))),
}

#: A pre-registered result: the stage that reports the metric, the value predicted, and how far
#: off the measurement may be for the prediction to count as met.
_PREDICTION = {"stage": OneOf(STAGES), "value": NUMBER, "tolerance": NUMBER, "description": Opt(str)}

#: Each scale factor and the recipe fields it multiplies.
SCALE_RULES: dict[str, tuple[str, ...]] = {
    "d_model": ("model.d_model",),
    "layers": ("model.layers",),
    "heads": ("model.heads",),
    "experts": ("model.experts",),
    "top_k": ("model.top_k",),
    "expert_hidden": ("model.expert_hidden",),
    "shared_experts": ("model.shared_experts",),
    "shared_hidden": ("model.shared_hidden",),
    "context": ("model.context", "model.attn_window"),
    "ranks": ("dispatch.ranks",),
    "batch": ("tokens.batch_sequences",),
    "tokens": ("tokens.budget", "posttrain.tokens"),
    "vocab": ("tokenizer.vocab_size",),
    "eval": ("eval.batches",),
}

#: A replica's ``repro`` section (the drop-fraction reproduction): how its one router is trained
#: (replica scale, not scaled from the reference) and what is measured. ``measure`` is the
#: workload's ``repro:`` section (arms, windows, measurement batch), checked by the workload's own
#: validation before any job starts.
_REPRO: dict[str, Any] = {
    "train": {
        "steps": int,
        "batch_sequences": int,
        "lr": NUMBER,
        "min_lr_ratio": Opt(NUMBER),
        "warmup_steps": Opt(int),
        "weight_decay": Opt(NUMBER),
        "grad_clip": Opt(NUMBER),
        "mixture": Opt(MapOf(NUMBER)),
        "checkpoint_every": Opt(int),
    },
    "measure": MapOf(object),
}


#: The recipe schema: a nested mapping of key -> type or marker.
RECIPE_SCHEMA: dict[str, Any] = {
    "name": str,
    "description": Opt(str),
    "reference": Opt(str),
    "seed": Opt(int),
    "model": {
        "d_model": int,
        "layers": int,
        "heads": int,
        "experts": int,
        "top_k": int,
        "expert_hidden": int,
        "shared_experts": int,
        "shared_hidden": int,
        "context": int,
        "attn_window": Opt(int),
        "routed_weight_sum": Opt(NUMBER),
        "rope_theta": Opt(NUMBER),
    },
    "routing": {
        "balancing": OneOf(("quantile", "none")),
        "aux_loss_coef": Opt(NUMBER),
        "z_loss_coef": Opt(NUMBER),
    },
    "dispatch": {
        "scheme": OneOf(("dropless", "fixed_all_to_all", "pooled_wave", "ragged", "waterfilling")),
        "ranks": int,
        "capacity_factor": NUMBER,
        "transport_capacity_factor": Opt(NUMBER),
        "waves": Opt(int),
        "chunks": Opt(int),
    },
    "data": {
        "domains": MapOf(str),
        "heldout_fraction": NUMBER,
        "max_bytes_per_domain": Opt(int, nullable=True),
        "max_sft_examples": Opt(int),
    },
    "tokenizer": {"vocab_size": int, "min_frequency": Opt(int)},
    "tokens": {
        "budget": NUMBER,
        "pretrain_fraction": NUMBER,
        "midtrain_fraction": NUMBER,
        "batch_sequences": int,
    },
    "pretrain": dict(_TRAIN),
    "midtrain": dict(_TRAIN),
    "posttrain": {"tokens": NUMBER, **{k: v for k, v in _TRAIN.items() if k != "mixture"}},
    "eval": {"batches": int},
    "hardware": Opt(
        {
            "system": str,
            "systems": int,
            "gpus_per_system": Opt(int),
            "expert_parallel": Opt(int),
            "notes": Opt(str),
        }
    ),
    "wandb": Opt({"project": str, "entity": Opt(str, nullable=True)}),
    # Predicted results (orchestrator.preregistration), checked when a run ends; a replica's own
    # ``preregistered`` replace these (a replica is a different model: its loss is another number).
    "preregistered": Opt(MapOf(_PREDICTION)),
    # Job resources per stage at full scale (``default``: every stage not named); a replica's own
    # ``resources`` replace these, since a replica at 1/100 scale must not ask for the hero's GPUs.
    "resources": Opt(MapOf(_RESOURCES)),
    "tracked_metrics": Opt(
        MapOf(
            {
                "stage": OneOf(STAGES),
                "relative": Opt(NUMBER),
                "absolute": Opt(NUMBER),
                # A noisy metric's standard error (another metric of the same stage) and how many
                # standard errors of the difference a change may be (orchestrator.nightly).
                "stderr": Opt(str),
                "sigmas": Opt(NUMBER),
                "description": Opt(str),
            }
        )
    ),
    "replicas": Opt(
        MapOf(
            {
                "description": Opt(str),
                "scale": Opt({key: Opt(RATIO) for key in SCALE_RULES}),
                "set": Opt(MapOf(object)),
                "runtime": Opt({"device": Opt(OneOf(("auto", "cpu", "cuda"))), "threads": Opt(int)}),
                "resources": Opt(MapOf(_RESOURCES)),
                "preregistered": Opt(MapOf(_PREDICTION)),
                # Which stages this replica runs (default: the training chain, data .. eval).
                "stages": Opt(ListOf(OneOf(STAGES))),
                # The drop-fraction reproduction (stage ``repro``), see _REPRO.
                "repro": Opt(_REPRO),
            }
        )
    ),
}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )


def _spec_name(spec: Any) -> str:
    if isinstance(spec, Opt):
        return _spec_name(spec.spec)
    if spec is NUMBER:
        return "number"
    if spec is RATIO:
        return "scale factor (number or 'a/b')"
    if isinstance(spec, OneOf):
        return "one of " + ", ".join(spec.choices)
    if isinstance(spec, (dict, MapOf)):
        return "mapping"
    if isinstance(spec, ListOf):
        return "list"
    return getattr(spec, "__name__", str(spec))


def parse_ratio(value: Any, where: str) -> Fraction:
    """A positive scale factor from ``0.25``, ``1`` or ``"1/4"`` as an exact fraction."""
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            frac = Fraction(value.replace(" ", ""))
        elif isinstance(value, int):
            frac = Fraction(value)
        elif isinstance(value, float):
            frac = Fraction(value).limit_denominator(10**12)
        else:
            raise ValueError
    except (ValueError, ZeroDivisionError):
        raise ConfigError(
            f"{where}: expected a scale factor (number or 'a/b'), got {_type_name(value)} {value!r}"
        ) from None
    if frac <= 0:
        raise ConfigError(f"{where}: scale factor must be positive, got {value!r}")
    return frac


def _check(value: Any, spec: Any, path: str, where: str) -> None:
    """Validate ``value`` against ``spec``; raise :class:`ConfigError` naming the key path."""
    label = f"{where}: {path}" if path else where
    if isinstance(spec, Opt):
        if value is None and spec.nullable:
            return
        _check(value, spec.spec, path, where)
        return
    if spec is object:
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{label}: expected mapping, got {_type_name(value)}")
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(f"{label}: keys must be strings, got {key!r}")
            if key not in spec:
                raise ConfigError(f"{where}: {path + '.' if path else ''}{key}: unknown key; {choices(key, spec)}")
        for key, sub in spec.items():
            sub_path = f"{path}.{key}" if path else key
            if key not in value:
                if isinstance(sub, Opt):
                    continue
                raise ConfigError(f"{where}: {sub_path}: missing (expected {_spec_name(sub)})")
            _check(value[key], sub, sub_path, where)
        return
    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            raise ConfigError(f"{label}: expected mapping, got {_type_name(value)}")
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{label}: keys must be strings, got {key!r}")
            _check(item, spec.spec, f"{path}.{key}" if path else key, where)
        return
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            raise ConfigError(f"{label}: expected list, got {_type_name(value)}")
        for i, item in enumerate(value):
            _check(item, spec.spec, f"{path}[{i}]", where)
        return
    if isinstance(spec, OneOf):
        if not isinstance(value, str) or value not in spec.choices:
            raise ConfigError(f"{label}: got {value!r}; {choices(value, spec.choices, label='expected one of')}")
        return
    if spec is RATIO:
        parse_ratio(value, label)
        return
    if spec is NUMBER:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{label}: expected number, got {_type_name(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{label}: expected a finite number, got {value!r}")
        return
    if spec is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label}: expected int, got {_type_name(value)}")
        return
    if spec is str:
        if not isinstance(value, str):
            raise ConfigError(f"{label}: expected str, got {_type_name(value)}")
        return
    raise AssertionError(f"bad schema at {path}: {spec!r}")  # pragma: no cover


def _schema_at(dotted: str, root: Any = RECIPE_SCHEMA) -> Any | None:
    node: Any = root
    for part in dotted.split("."):
        if isinstance(node, Opt):
            node = node.spec
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, MapOf):
            node = node.spec
        else:
            return None
    return node


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _put(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


#: Top-level recipe keys no ``set`` may change: what names the recipe, and what a replica states
#: for itself (its own ``resources`` and ``preregistered`` replace the recipe's, so a value set
#: there would be ignored without a word).
_NOT_SETTABLE = ("name", "description", "reference", "replicas", "resources", "preregistered")


def _leaves(node: Any, prefix: str = "") -> list[str]:
    """The dotted names a ``set`` can name under ``node`` (a free-form map's keys are the user's)."""
    if isinstance(node, Opt):
        node = node.spec
    if not isinstance(node, dict):
        return [prefix]
    return [leaf for key, spec in node.items() for leaf in _leaves(spec, f"{prefix}{key}.")]


def settable_fields(*, repro: bool = False) -> list[str]:
    """Every recipe value ``--set`` (or a replica's ``set``) may name, for a typo's hint."""
    names = [n.rstrip(".") for k, v in RECIPE_SCHEMA.items() if k not in _NOT_SETTABLE for n in _leaves(v, f"{k}.")]
    if repro:
        names += [n.rstrip(".") for n in _leaves(_REPRO, "repro.")]
    return names


def check_set(dotted: str, value: Any, label: str, where: str, *, repro: bool = False) -> None:
    """Refuse a ``set`` of ``dotted`` to ``value`` that is no recipe field, a whole section, a key
    that would be ignored, or a value of the wrong type, in one line naming ``label``.

    ``repro``: ``repro.…`` names the replica's own reproduction section (``--set`` on a replica
    that has one), not a recipe field.
    """
    top = dotted.split(".")[0]
    if top in _NOT_SETTABLE:
        what = "names the recipe" if top in ("name", "description", "reference") else "is the replica's own"
        raise ConfigError(f"{where}: {label}: {top} {what} and cannot be set; edit the recipe file")
    spec = _schema_at(dotted[len("repro.") :], _REPRO) if repro and top == "repro" else _schema_at(dotted)
    if spec is None or isinstance(spec, dict):
        known = settable_fields(repro=repro)
        if isinstance(spec, dict):  # a whole section: name one of its values
            raise ConfigError(
                f"{where}: {label}: a section, not a value; set one of: "
                + ", ".join(n for n in known if n.startswith(f"{dotted}."))
            )
        raise ConfigError(f"{where}: {label}: no such recipe field; {_field_hint(dotted, known)}")
    _check(value, spec, label, where)


def _field_hint(dotted: str, known: Sequence[str]) -> str:
    """``did you mean 'pretrain.lr'?``, else the fields of the section named, else the sections:
    a line a person reads, where all seventy fields would not be. Within a known section only
    the rest of the name is compared (every ``pretrain.…`` is otherwise close to ``pretrain.foo``)."""
    section, _, rest = dotted.partition(".")
    inside = [n for n in known if n.startswith(f"{section}.")]
    if inside:
        close = difflib.get_close_matches(rest, [n[len(section) + 1 :] for n in inside], n=1)
        if close:
            return f"did you mean '{section}.{close[0]}'?"
        return f"fields of {section}: {', '.join(inside)}"
    close = difflib.get_close_matches(dotted, known, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return "sections: " + ", ".join(dict.fromkeys(n.split(".")[0] for n in known))


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-4`` as the number it is (YAML 1.2, and every other YAML
    reader, do; PyYAML's 1.1 rules want ``1.0e-4`` and made ``--set pretrain.lr=1e-4`` the text
    "1e-4", refused as "expected number, got str")."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """``text`` read as YAML by :class:`YamlLoader` (safe: no arbitrary objects)."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


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


@dataclass(frozen=True)
class Recipe:
    """A validated recipe file: the reference run and its replica definitions."""

    name: str
    path: Path
    data: dict[str, Any]
    #: BLAKE3 of the canonical recipe content (what lineage records as the reference).
    content_hash: str

    @property
    def replicas(self) -> dict[str, Any]:
        return dict(self.data.get("replicas") or {})

    @property
    def label(self) -> str:
        return f"recipe {self.path.name}"


@dataclass(frozen=True)
class TrackedMetric:
    """A metric the nightly verdict compares, with its tolerance."""

    name: str
    stage: str
    relative: float | None = None
    absolute: float | None = None
    #: The metric holding this one's standard error, and the allowed change in standard errors.
    stderr: str | None = None
    sigmas: float | None = None

    def within(self, old: float, new: float, old_se: float | None = None, new_se: float | None = None) -> bool:
        """Whether ``new`` is within tolerance of ``old``, as the nightly verdict decides it."""
        (tol,) = parse_tolerances([self])
        return not check_metric(tol, old, new, old_se, new_se).regressed


@dataclass(frozen=True)
class ResolvedRecipe:
    """A recipe at one scale: concrete per-stage workload configs plus how they were derived."""

    recipe: Recipe
    replica: str | None
    #: Scale factors as written (``"1/96"``) and as floats.
    scale: dict[str, str]
    #: Explicit ``set`` values of the replica (dotted key -> value).
    overrides: dict[str, Any]
    runtime: dict[str, Any]
    #: The recipe values after scaling and ``set`` (same shape as the recipe).
    values: dict[str, Any]
    #: Stage name -> workload config (without ``inputs`` and ``wandb``, which the pipeline adds).
    stage_configs: dict[str, dict[str, Any]]
    tracked_metrics: tuple[TrackedMetric, ...] = ()
    derived: dict[str, Any] = field(default_factory=dict)
    #: The stages this replica runs, in pipeline order (the keys of ``stage_configs``).
    stages: tuple[str, ...] = DEFAULT_STAGES
    #: Stage name -> the job resources it asks for (``cpus``, ``memory``, ``gpus``, ``time_limit``).
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Predicted results of the stages this replica runs (orchestrator.preregistration).
    preregistered: tuple[Prediction, ...] = ()
    #: Values set for this run only (``openlab run --set``, the flow's ``overrides``), applied
    #: after the replica's ``set``: an experiment without a new recipe file.
    run_set: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.recipe.name}:{self.replica}" if self.replica else self.recipe.name

    @property
    def wandb(self) -> dict[str, Any]:
        return dict(self.values.get("wandb") or {})

    def until(self, stage: str | None, where: str = "--until") -> ResolvedRecipe:
        """This replica cut after ``stage`` (it and what it reads from); None: all of it. ``where``:
        the option that named the stage, for the error when it is none of this replica's.

        The stages that remain are the same stages with the same configs, so their identities,
        and what a later full run reuses, do not change.
        """
        if stage is None:
            return self
        from orchestrator.pipeline.dag import stages_until  # not at import: the pipeline imports recipes

        kept = stages_until(stage, self.stages, where)
        return replace(
            self,
            stages=kept,
            stage_configs={k: v for k, v in self.stage_configs.items() if k in kept},
            resources={k: v for k, v in self.resources.items() if k in kept},
            tracked_metrics=tuple(m for m in self.tracked_metrics if m.stage in kept),
            preregistered=tuple(p for p in self.preregistered if p.stage in kept),
        )

    def lineage(self) -> dict[str, Any]:
        """What a pipeline run records about its recipe: reference, factors, settings, derived numbers."""
        return {
            "recipe": self.recipe.name,
            "recipe_path": str(self.recipe.path),
            "recipe_hash": self.recipe.content_hash,
            "reference": self.recipe.data.get("reference"),
            "replica": self.replica,
            "scale": dict(self.scale),
            "scale_float": {k: float(Fraction(v)) for k, v in self.scale.items()},
            "set": dict(self.overrides),
            "run_set": dict(self.run_set),
            "runtime": dict(self.runtime),
            "derived": dict(self.derived),
            "stages": list(self.stages),
            "resources": {k: dict(v) for k, v in self.resources.items()},
            # recorded when the run starts: the event log dates each prediction before its result
            "preregistered": [asdict(p) for p in self.preregistered],
        }


def find_recipe(ref: str | Path, recipes_dir: Path | None = None, *, root: Path | None = None) -> Path:
    """The recipe file for a path or a bare name (looked up in ``recipes/``).

    ``root`` is the tree a run executes (a checked-out git ref): a relative path or a name is
    looked up there first, so a run of an older commit uses that commit's recipe with its code.
    """
    candidate = Path(ref).expanduser()
    if root is not None and not candidate.is_absolute():
        if (root / candidate).is_file():
            return root / candidate
        recipes_dir = recipes_dir or root / "recipes"
    if candidate.is_file():
        return candidate
    folder = recipes_dir or RECIPES_DIR
    for name in (str(ref), f"{ref}.yaml", f"{ref}.yml"):
        path = folder / name
        if path.is_file():
            return path
    if candidate.is_dir():  # after the names: a folder here called like a recipe does not hide it
        inside = ", ".join(sorted(p.name for p in candidate.glob("*.y*ml"))[:10])
        hint = f"one of its recipes ({inside})" if inside else "a recipe file (a .yaml)"
        raise ConfigError(f"recipe {ref}: is a folder, not a recipe; give {hint} or a recipe name")
    known = sorted(p.stem for p in folder.glob("*.y*ml")) if folder.is_dir() else []
    hint = choices(Path(str(ref)).stem, known) if known else "it has none"
    raise ConfigError(f"recipe {ref}: no such file, and no recipe of that name in {folder}; {hint}")


def load_recipe(ref: str | Path, recipes_dir: Path | None = None, *, root: Path | None = None) -> Recipe:
    """Read and validate a recipe (:func:`load_yaml`: no arbitrary objects from YAML)."""
    path = find_recipe(ref, recipes_dir, root=root)
    where = f"recipe {path.name}"
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror}") from None
    return parse_recipe(data, path)


def check_values(
    values: Mapping[str, Any],
    where: str,
    repro: Mapping[str, Any] | None = None,
    stages: Sequence[str] = ("pretrain", "midtrain", "repro"),
) -> None:
    """The rules that tie one recipe value to another, checked on the file and again on the values
    a replica's ``set`` and a run's ``--set`` leave: the token split adds up, and the mixture of
    each of ``stages`` draws on domains the data stage builds (else it failed after data and
    tokenize had run)."""
    total = values["tokens"]["pretrain_fraction"] + values["tokens"]["midtrain_fraction"]
    if abs(total - 1.0) > 1e-9:
        raise ConfigError(f"{where}: tokens: pretrain_fraction + midtrain_fraction must be 1, got {total:g}")
    domains = sorted((values.get("data") or {}).get("domains") or {})
    mixtures = {f"{stage}.mixture": (values.get(stage) or {}).get("mixture") for stage in ("pretrain", "midtrain")}
    mixtures["repro.train.mixture"] = ((repro or {}).get("train") or {}).get("mixture")
    for name, mixture in mixtures.items():
        if name.split(".")[0] not in stages:  # a stage this replica does not run reads no data
            continue
        unknown = sorted(set(mixture or {}) - set(domains))
        if unknown:
            raise ConfigError(
                f"{where}: {name}: domain {', '.join(map(repr, unknown))} is not one of data.domains "
                f"({', '.join(domains) or 'none'})"
            )


def parse_recipe(data: Any, path: Path) -> Recipe:
    """Validate already-parsed recipe data (used by :func:`load_recipe` and tests)."""
    where = f"recipe {path.name}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping, got {_type_name(data)}")
    _check(data, RECIPE_SCHEMA, "", where)
    check_values(data, where)
    parse_tolerances(data.get("tracked_metrics") or {}, f"{where}: tracked_metrics")  # the verdict's own rules
    for rname, replica in (data.get("replicas") or {}).items():
        for dotted, value in (replica.get("set") or {}).items():
            check_set(dotted, value, f"replicas.{rname}.set.{dotted}", where)
    return Recipe(name=data["name"], path=path.resolve(), data=data, content_hash=hash_json(data))


def _scaled(value: Any, factor: Fraction, path: str) -> Any:
    if value is None:
        return None
    if isinstance(value, int):
        return max(1, int(round(Fraction(value) * factor)))
    return float(Fraction(value).limit_denominator(10**12) * factor)


def resolve(
    recipe: Recipe | str | Path,
    replica: str | None = None,
    *,
    validate: bool = True,
    root: Path | None = None,
    sets: Mapping[str, Any] | None = None,
    sets_from: Mapping[str, str] | None = None,
) -> ResolvedRecipe:
    """Concrete per-stage workload configs for ``recipe`` at ``replica`` scale (None: full scale),
    read from the tree ``root`` when given (see :func:`find_recipe`).

    ``sets`` (dotted key -> value, ``openlab run --set``) are applied last, as written (not
    scaled), over the replica's own ``set``: they change the stages' configs, hence their
    identities, and the pipeline run records them (``run_set``). ``sets_from`` names where a
    key's value was given, as its error says it (``--grid``, the run form's ``overrides``):
    ``--set`` by default.
    """
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, root=root)
    where = recipe.label
    values = copy.deepcopy({k: v for k, v in recipe.data.items() if k != "replicas"})
    scale: dict[str, str] = {}
    overrides: dict[str, Any] = {}
    runtime: dict[str, Any] = {"device": "auto", "threads": 0}
    stages: Sequence[str] = DEFAULT_STAGES
    repro: dict[str, Any] | None = None
    if replica is not None:
        replicas = recipe.replicas
        if replica not in replicas:
            hint = choices(replica, replicas) if replicas else "it has none"
            raise ConfigError(f"{where}: no replica {replica!r}; {hint}")
        spec = replicas[replica]
        for key, raw in (spec.get("scale") or {}).items():
            factor = parse_ratio(raw, f"{where}: replicas.{replica}.scale.{key}")
            scale[key] = str(factor)
            for dotted in SCALE_RULES[key]:
                current = _get(values, dotted)
                if current is not None:
                    _put(values, dotted, _scaled(current, factor, dotted))
        for dotted, value in (spec.get("set") or {}).items():
            overrides[dotted] = value
            _put(values, dotted, value)
        runtime.update(spec.get("runtime") or {})
        repro = copy.deepcopy(spec.get("repro"))  # a --set may change it: not the recipe's own
        stages = spec.get("stages") or DEFAULT_STAGES
        from orchestrator.pipeline.dag import check_stage_selection  # not at import: the pipeline imports recipes

        stages = check_stage_selection(stages, f"{where}: replicas.{replica}.stages")
        if "repro" in stages and repro is None:
            raise ConfigError(
                f"{where}: replicas.{replica}: stage repro needs a repro section (train, measure) in the replica"
            )
        if repro is not None and "repro" not in stages:
            raise ConfigError(f"{where}: replicas.{replica}: has a repro section but its stages do not include repro")
    for dotted, value in (sets or {}).items():
        check_set(dotted, value, f"{(sets_from or {}).get(dotted, '--set')} {dotted}", where, repro=repro is not None)
        if repro is not None and dotted.startswith("repro."):
            _put(repro, dotted[len("repro.") :], value)
        else:
            _put(values, dotted, value)
    check_values(values, where, repro, stages)  # what the sets left must still hang together
    source = recipe.replicas[replica] if replica is not None else recipe.data
    predicted = source.get("preregistered") or {}
    for name, p in predicted.items():
        if p["tolerance"] < 0:
            raise ConfigError(f"{where}: preregistered.{name}.tolerance: must be 0 or more, got {p['tolerance']!r}")
    # A prediction for a stage this run does not have can never be checked: it is left out, as a
    # tracked metric is (a recipe-wide prediction for `eval` means nothing to the `drops` replica).
    predictions = tuple(
        Prediction(name, p["stage"], float(p["value"]), float(p["tolerance"]), p.get("description"))
        for name, p in predicted.items()
        if p["stage"] in stages
    )
    asked = recipe.replicas[replica].get("resources") if replica is not None else recipe.data.get("resources")
    where_resources = f"{where}: replicas.{replica}.resources" if replica is not None else f"{where}: resources"
    resources = stage_resources(asked or {}, stages, where_resources)
    configs, derived = _stage_configs(values, runtime, stages, repro)
    # A metric of a stage this replica does not run cannot be compared: it is not tracked here.
    tracked = tuple(
        TrackedMetric(
            name=n,
            stage=m["stage"],
            relative=m.get("relative"),
            absolute=m.get("absolute"),
            stderr=m.get("stderr"),
            sigmas=m.get("sigmas"),
        )
        for n, m in (values.get("tracked_metrics") or {}).items()
        if m["stage"] in stages
    )
    resolved = ResolvedRecipe(
        recipe=recipe,
        replica=replica,
        scale=scale,
        overrides=overrides,
        runtime=runtime,
        values=values,
        stage_configs=configs,
        tracked_metrics=tracked,
        derived=derived,
        stages=tuple(stages),
        resources=resources,
        preregistered=predictions,
        run_set=dict(sets or {}),
    )
    if validate:
        validate_workload_configs(resolved)
    return resolved


def stage_resources(
    asked: Mapping[str, Mapping[str, Any]], stages: Sequence[str], where: str
) -> dict[str, dict[str, Any]]:
    """Each stage's job resources: its own entry over ``default``, checked as a job would check them.

    A stage the replica does not run is an error (a typo would otherwise leave pretrain on the
    cluster's default of no GPU); so is a value no backend could honour.
    """
    unknown = [k for k in asked if k != "default" and k not in stages]
    if unknown:
        hint = choices(unknown[0], [*stages, "default"], label="stages")
        raise ConfigError(f"{where}.{unknown[0]}: not a stage this runs; {hint}")
    for name, entry in asked.items():
        label = f"{where}.{name}"
        if "cpus" in entry and entry["cpus"] <= 0:
            raise ConfigError(f"{label}.cpus: must be positive, got {entry['cpus']!r}")
        if "gpus" in entry and entry["gpus"] < 0:
            raise ConfigError(f"{label}.gpus: must be 0 or more, got {entry['gpus']!r}")
        if "time_limit" in entry and entry["time_limit"] <= 0:
            raise ConfigError(f"{label}.time_limit: seconds, must be positive, got {entry['time_limit']!r}")
        for key in ("nodes", "tasks_per_node"):
            if key in entry and entry[key] < 1:
                raise ConfigError(f"{label}.{key}: must be 1 or more, got {entry[key]!r}")

        sizes = {"memory": entry.get("memory"), "docker.shm_size": (entry.get("docker") or {}).get("shm_size")}
        for key, value in sizes.items():
            if value is None:
                continue
            try:
                parse_memory(value)
            except OpenlabError:
                raise ConfigError(
                    f"{label}.{key}: invalid {value!r}: a number with K, M, G or T, e.g. 512M or 2G"
                ) from None
    default = dict(asked.get("default") or {})
    out: dict[str, dict[str, Any]] = {}
    for stage in stages:
        if not default and stage not in asked:
            continue
        own = dict(asked.get(stage) or {})
        merged = {**default, **own}
        for backend in BACKEND_OPTIONS:  # a stage's partition over the default's account
            if backend in default and backend in own:
                merged[backend] = {**default[backend], **own[backend]}
        out[stage] = merged
        if merged.get("nodes", 1) * merged.get("tasks_per_node", 1) > 1 and stage not in TRAINING_STAGES:
            source = stage if "nodes" in own or "tasks_per_node" in own else "default"
            raise ConfigError(
                f"{where}.{source}: stage {stage} runs as one task; only {', '.join(TRAINING_STAGES)} train over "
                "several (nodes, tasks_per_node)"
            )
    return out


def _train_section(section: Mapping[str, Any], steps: int, batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "steps": steps,
        "batch_size": batch,
        "lr": section["lr"],
        "min_lr_ratio": section["min_lr_ratio"],
        "warmup_steps": max(1, int(round(section["warmup_fraction"] * steps))) if steps > 1 else 0,
        "weight_decay": section["weight_decay"],
        "grad_clip": section["grad_clip"],
        "checkpoint_every": max(1, min(int(section["checkpoint_every"]), steps)),
    }
    if section.get("mixture"):
        out["mixture"] = dict(section["mixture"])
    if section.get("keep_every"):  # only when asked: a stage that keeps none keeps its identity
        out["keep_every"] = int(section["keep_every"])
    return out


def _repro_train(section: Mapping[str, Any]) -> dict[str, Any]:
    """The ``train:`` section of the repro stage: the replica's values as given (the workload's
    defaults fill the rest), with ``batch_sequences`` under the workload's name."""
    out = {"batch_size" if k == "batch_sequences" else k: v for k, v in section.items()}
    if "mixture" in out:
        out["mixture"] = dict(out["mixture"])
    return out


def _stage_configs(
    v: Mapping[str, Any],
    runtime: Mapping[str, Any],
    stages: Sequence[str] = DEFAULT_STAGES,
    repro: Mapping[str, Any] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Map recipe values onto the workload's per-stage config schema, for ``stages``.

    Each stage gets only the sections it reads, so its identity changes only when
    something it depends on changes (a new model shape does not re-run ``data``).
    """
    model, tokens, dispatch, routing = v["model"], v["tokens"], v["dispatch"], v["routing"]
    batch = int(tokens["batch_sequences"])
    context = int(model["context"])
    per_step = batch * context
    pre_steps = max(1, int(round(tokens["budget"] * tokens["pretrain_fraction"] / per_step)))
    mid_steps = max(1, int(round(tokens["budget"] * tokens["midtrain_fraction"] / per_step)))
    post_steps = max(1, int(round(v["posttrain"]["tokens"] / per_step)))
    seed = int(v.get("seed", 0))
    rt = {k: runtime[k] for k in RUNTIME_KEYS if k in runtime}
    moe = {
        "dispatch": dispatch["scheme"],
        "ranks": dispatch["ranks"],
        "capacity_factor": dispatch["capacity_factor"],
        "transport_capacity_factor": dispatch.get("transport_capacity_factor", 1.05),
        "waves": dispatch.get("waves", 3),
        "chunks": dispatch.get("chunks", 2),
        "qb": routing["balancing"] == "quantile",
        "aux_loss_coef": routing.get("aux_loss_coef", 0.0),
        "z_loss_coef": routing.get("z_loss_coef", 0.0),
    }
    model_cfg: dict[str, Any] = {
        "d_model": model["d_model"],
        "n_layers": model["layers"],
        "n_heads": model["heads"],
        "context": context,
        "attn_window": model.get("attn_window", 0),
        "n_experts": model["experts"],
        "top_k": model["top_k"],
        "expert_hidden": model["expert_hidden"],
        "n_shared": model["shared_experts"],
        "shared_hidden": model["shared_hidden"],
    }
    for key in ("routed_weight_sum", "rope_theta"):
        if key in model:
            model_cfg[key] = model[key]
    data_cfg: dict[str, Any] = {
        "domains": dict(v["data"]["domains"]),
        "heldout_fraction": v["data"]["heldout_fraction"],
    }
    if v["data"].get("max_bytes_per_domain") is not None:
        data_cfg["max_bytes_per_domain"] = v["data"]["max_bytes_per_domain"]
    if "max_sft_examples" in v["data"]:
        data_cfg["max_sft_examples"] = v["data"]["max_sft_examples"]
    tok_cfg = {"vocab_size": v["tokenizer"]["vocab_size"]}
    if "min_frequency" in v["tokenizer"]:
        tok_cfg["min_frequency"] = v["tokenizer"]["min_frequency"]
    configs = {
        "data": {"seed": seed, "data": data_cfg},
        "tokenize": {"seed": seed, "tokenizer": tok_cfg},
        "pretrain": {
            "seed": seed,
            **rt,
            "model": model_cfg,
            "moe": moe,
            "train": _train_section(v["pretrain"], pre_steps, batch),
        },
        "midtrain": {"seed": seed, **rt, "moe": moe, "train": _train_section(v["midtrain"], mid_steps, batch)},
        "posttrain": {"seed": seed, **rt, "moe": moe, "train": _train_section(v["posttrain"], post_steps, batch)},
        "eval": {"seed": seed, **rt, "moe": moe, "eval": {"batches": v["eval"]["batches"], "batch_size": batch}},
    }
    derived: dict[str, Any] = {}
    if any(s in stages for s in ("pretrain", "midtrain", "posttrain", "eval")):
        derived = {
            "tokens_per_step": per_step,
            "pretrain_steps": pre_steps,
            "midtrain_steps": mid_steps,
            "posttrain_steps": post_steps,
            "pretrain_tokens": pre_steps * per_step,
            "midtrain_tokens": mid_steps * per_step,
        }
    if repro is not None:
        train = _repro_train(repro["train"])
        configs["repro"] = {
            "seed": seed,
            **rt,
            "model": model_cfg,
            # Every arm brings its own dispatch and capacities; the recipe's gate scheme is not read,
            # so it stays out of the stage's identity.
            "moe": {k: moe[k] for k in ("ranks", "qb", "aux_loss_coef", "z_loss_coef")},
            "train": train,
            "repro": copy.deepcopy(dict(repro["measure"])),
        }
        derived["repro_steps"] = train["steps"]
        derived["repro_tokens"] = train["steps"] * train["batch_size"] * context
    return {s: configs[s] for s in stages}, derived


_PLACEHOLDER_INPUTS = {
    "corpus": "/nonexistent/corpus",
    "tokens": "/nonexistent/tokens",
    "checkpoint": "/nonexistent/ckpt",
}


def validate_workload_configs(resolved: ResolvedRecipe) -> None:
    """Run the workload's own config checks on every stage config before any job starts."""
    try:
        from workloads.moe import config as wcfg
    except ImportError:  # the workload is optional for the orchestrator itself
        return
    label = f"{resolved.recipe.label}" + (f" replica {resolved.replica}" if resolved.replica else "")
    # The stage that builds the model (pretrain, or repro in a drop-fraction replica) carries its shape
    # and batch; the others are checked against them.
    builder = next((resolved.stage_configs[s] for s in ("pretrain", "repro") if s in resolved.stage_configs), None)
    for stage, cfg in resolved.stage_configs.items():
        # The workload checks batch sizes of sections a stage does not read; give those the run's batch.
        batch = builder["train"]["batch_size"] if builder is not None else 1
        full = {
            "train": {"batch_size": batch},
            "eval": {"batch_size": batch},
            **cfg,
            "inputs": dict(_PLACEHOLDER_INPUTS),
        }
        try:
            parsed = wcfg.parse_config(full)
            wcfg.validate(parsed, stage)
            if builder is not None and "model" not in cfg and "moe" in cfg:
                # later stages take the model from the checkpoint; check the shape once against their moe
                wcfg.validate_model(wcfg.parse_config({"model": builder["model"]}).model, parsed.moe.ranks)
        except wcfg.WorkloadError as exc:
            raise ConfigError(f"{label}: stage {stage}: {exc}") from None


def identity_config(config: Mapping[str, Any], tasks: int = 1) -> dict[str, Any]:
    """The part of a stage config that decides its result: no inputs (by content instead),
    no W&B settings and no runtime placement (device, threads).

    ``tasks``, the processes a training stage runs as, is part of it when there are several: each
    task's share of the global batch is what the simulated expert-parallel ranks split, so the
    drops, the balancing and the result differ with it (one task keeps earlier identities)."""
    out = {k: v for k, v in config.items() if k not in ("inputs", "wandb", *RUNTIME_KEYS)}
    if tasks > 1:
        out["tasks"] = tasks
    return out


__all__ = [
    "RECIPES_DIR",
    "RECIPE_SCHEMA",
    "DEFAULT_STAGES",
    "SCALE_RULES",
    "STAGES",
    "Recipe",
    "ResolvedRecipe",
    "TrackedMetric",
    "find_recipe",
    "identity_config",
    "load_recipe",
    "parse_ratio",
    "parse_recipe",
    "resolve",
    "validate_workload_configs",
]
