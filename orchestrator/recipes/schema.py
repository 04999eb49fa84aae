"""What a recipe may say: its schema, the check of a value against it, and how YAML is read.

:data:`RECIPE_SCHEMA` is the one description of a recipe file's keys, types and ranges;
:func:`check_schema` validates a value against it, naming the key path (``recipe marin-535b-a23b.yaml:
model.experts: expected int, got str``; ``pretrain.lr: must be positive (the peak learning rate), got
-1``), and :func:`check_set` does the same for one ``--set``. Kept apart from
:mod:`orchestrator.recipes.recipe` (loading and resolving) so the overrides a command line gives
(:mod:`orchestrator.recipes.overrides`) are checked against the very schema the file is.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import yaml

from orchestrator.errors import ConfigError, OpenlabError, choices
from orchestrator.launchers.base import BACKENDS, parse_duration

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


class _Duration:
    """Schema marker: seconds, written ``7200`` or as a duration, ``"2h"`` or Slurm's ``"2-00:00:00"``
    (:func:`~orchestrator.launchers.base.parse_duration`); :func:`seconds` reads it."""


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


@dataclass(frozen=True)
class Range:
    """Schema marker: a number (``spec``: :data:`NUMBER` or ``int``) from ``low`` to ``high`` (None:
    no bound), each bound allowed unless ``above`` / ``below`` exclude it; ``what`` says what the
    value is, in the error that gives the range (``pretrain.lr: must be positive (the peak learning
    rate), got -1``). Every range a recipe value has is stated here, in the schema, so the file, a
    replica's ``set`` and a run's ``--set`` are held to the same one, before any job starts."""

    spec: Any
    low: float | None = None
    high: float | None = None
    above: bool = False
    below: bool = False
    what: str = ""

    def allowed(self) -> str:
        """``positive``, ``1 or more``, ``in [0, 1]``: the range, as the error says it."""
        low, high = _bound(self.low), _bound(self.high)
        if self.high is None:
            if self.above:
                return "positive" if self.low == 0 else f"more than {low}"
            return f"{low} or more"
        if self.low is None:
            return f"under {high}" if self.below else f"{high} or less"
        return f"in {'(' if self.above else '['}{low}, {high}{')' if self.below else ']'}"

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or (value < self.high if self.below else value <= self.high)


def _bound(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


NUMBER = _Number()
RATIO = _Ratio()
DURATION = _Duration()


def positive(what: str, spec: Any = None) -> Range:
    """A number above 0 (``spec``: :data:`NUMBER` unless given)."""
    return Range(NUMBER if spec is None else spec, low=0, above=True, what=what)


def at_least(low: int, what: str, spec: Any = int) -> Range:
    """A count (``spec``: ``int`` unless given) of ``low`` or more."""
    return Range(spec, low=low, what=what)


def fraction(what: str, *, open_: bool = False) -> Range:
    """A share of a whole: in [0, 1], or in (0, 1) when ``open_`` (neither end allowed)."""
    return Range(NUMBER, low=0, high=1, above=open_, below=open_, what=what)


#: A domain's weight in a training mixture (the weights are normalised; the workload refuses all zero).
_WEIGHT = Range(NUMBER, low=0, what="a domain's weight in the mixture")

_TRAIN = {
    "lr": positive("the peak learning rate"),
    "min_lr_ratio": fraction("the final learning rate over the peak"),
    "warmup_fraction": fraction("the share of the stage's steps that warm the learning rate up"),
    "weight_decay": Range(NUMBER, low=0, what="AdamW's weight decay; 0: none"),
    # torch's clip_grad_norm_ scales the gradients to at most this norm: 0 zeroes them, below 0 flips them
    "grad_clip": positive("the largest gradient norm kept; 0 would zero every gradient"),
    "mixture": Opt(MapOf(_WEIGHT)),
    "checkpoint_every": at_least(1, "steps between checkpoints"),
    #: Keep every N-th step's checkpoint as an immutable revision (the workload's train.keep_every).
    "keep_every": Opt(at_least(0, "keep every N-th step's checkpoint; 0: only the latest")),
}

#: Where a stage's Slurm job goes (``#SBATCH --partition`` ...), per stage: data prep on a CPU
#: partition, training on a GPU one. Over ``[backends.slurm]``; used only when the run is on Slurm.
_SLURM_STAGE_OPTIONS = {
    "partition": Opt(str),
    "account": Opt(str),
    "qos": Opt(str),
    "constraint": Opt(str),
    "nodelist": Opt(str),
    "gpu_type": Opt(str),
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
    "cpus": Opt(positive("CPU cores")),
    "memory": Opt(str),
    "gpus": Opt(at_least(0, "GPUs")),
    "time_limit": Opt(DURATION),
    # Seconds ahead of time_limit a stage that checkpoints is sent SIGUSR1 to save and stop (0: not
    # warned); default a tenth of the limit, at most 5 minutes (orchestrator.pipeline.checkpoints).
    "warn_before_limit": Opt(DURATION),
    # A training stage as several processes of one job (data parallel; Slurm: srun tasks).
    "nodes": Opt(at_least(1, "nodes of the job")),
    "tasks_per_node": Opt(at_least(1, "processes on each node")),
    "slurm": Opt(_SLURM_STAGE_OPTIONS),
    "kubernetes": Opt(_KUBERNETES_STAGE_OPTIONS),
    "docker": Opt(_DOCKER_STAGE_OPTIONS),
    # Where the stage's job runs, over the run's backend (data prep here, training on the cluster).
    "backend": Opt(OneOf(tuple(BACKENDS))),
}

#: The resources written as durations (seconds or "2h"), which a resolved recipe holds as seconds.
DURATION_KEYS = tuple(key for key, spec in _RESOURCES.items() if isinstance(spec, Opt) and spec.spec is DURATION)

#: A pre-registered result: the stage that reports the metric, the value predicted, and how far
#: off the measurement may be for the prediction to count as met.
_PREDICTION = {
    "stage": OneOf(STAGES),
    "value": NUMBER,
    "tolerance": at_least(0, "how far off the measurement may be", spec=NUMBER),
    "description": Opt(str),
}

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
        "steps": at_least(1, "training steps"),
        "batch_sequences": at_least(1, "sequences per step"),
        "lr": _TRAIN["lr"],
        "min_lr_ratio": Opt(_TRAIN["min_lr_ratio"]),
        "warmup_steps": Opt(at_least(0, "steps that warm the learning rate up")),
        "weight_decay": Opt(_TRAIN["weight_decay"]),
        "grad_clip": Opt(_TRAIN["grad_clip"]),
        "mixture": Opt(MapOf(_WEIGHT)),
        "checkpoint_every": Opt(_TRAIN["checkpoint_every"]),
    },
    "measure": MapOf(object),
}


#: The recipe schema: a nested mapping of key -> type or marker.
RECIPE_SCHEMA: dict[str, Any] = {
    "name": str,
    "description": Opt(str),
    "reference": Opt(str),
    "seed": Opt(at_least(0, "the run's random seed")),
    "model": {
        "d_model": at_least(1, "the model width"),
        "layers": at_least(1, "transformer layers"),
        "heads": at_least(1, "attention heads"),
        "experts": at_least(1, "routed experts"),
        "top_k": at_least(1, "routed experts per token"),
        "expert_hidden": at_least(1, "a routed expert's hidden width"),
        "shared_experts": at_least(0, "always-on experts; 0: none"),
        "shared_hidden": at_least(0, "a shared expert's hidden width"),
        "context": at_least(1, "tokens per sequence"),
        "attn_window": Opt(at_least(0, "tokens a sliding window attends to; 0: full causal attention")),
        "routed_weight_sum": Opt(positive("what a token's routed expert weights sum to")),
        "rope_theta": Opt(Range(NUMBER, low=1, above=True, what="the RoPE base, e.g. 10000")),
    },
    "routing": {
        "balancing": OneOf(("quantile", "none")),
        "aux_loss_coef": Opt(Range(NUMBER, low=0, what="the load-balancing loss's weight; 0: off")),
        "z_loss_coef": Opt(Range(NUMBER, low=0, what="the router z-loss's weight; 0: off")),
    },
    "dispatch": {
        "scheme": OneOf(("dropless", "fixed_all_to_all", "pooled_wave", "ragged", "waterfilling")),
        "ranks": at_least(1, "expert-parallel ranks"),
        "capacity_factor": positive("a receiver's capacity over its even share"),
        "transport_capacity_factor": Opt(positive("pooled_wave's sender capacity over its even share")),
        "waves": Opt(at_least(1, "pooled_wave's waves")),
        "chunks": Opt(at_least(1, "ragged's chunks")),
    },
    "data": {
        "domains": MapOf(str),
        "heldout_fraction": fraction("the share of the documents held out", open_=True),
        "max_bytes_per_domain": Opt(at_least(1, "bytes of text taken per domain"), nullable=True),
        "max_sft_examples": Opt(at_least(1, "post-training examples taken")),
    },
    "tokenizer": {
        "vocab_size": at_least(300, "256 bytes, the merges and the special tokens"),
        "min_frequency": Opt(at_least(1, "how often a pair must occur to be merged")),
    },
    "tokens": {
        "budget": positive("the tokens of pretrain and midtrain"),
        "pretrain_fraction": fraction("pretrain's share of the budget"),
        "midtrain_fraction": fraction("midtrain's share of the budget"),
        "batch_sequences": at_least(1, "sequences per step"),
    },
    "pretrain": dict(_TRAIN),
    "midtrain": dict(_TRAIN),
    "posttrain": {"tokens": positive("the tokens of posttrain"), **{k: v for k, v in _TRAIN.items() if k != "mixture"}},
    "eval": {"batches": at_least(1, "held-out batches per domain")},
    "hardware": Opt(
        {
            "system": str,
            "systems": at_least(1, "systems the run takes"),
            "gpus_per_system": Opt(at_least(1, "GPUs in each system")),
            "expert_parallel": Opt(at_least(1, "expert-parallel degree")),
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
                # which way is a regression: higher (a loss), lower (an accuracy), either (the default)
                "worse": Opt(OneOf(("either", "higher", "lower"))),
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
                "runtime": Opt(
                    {
                        "device": Opt(OneOf(("auto", "cpu", "cuda"))),
                        "threads": Opt(at_least(0, "CPU threads; 0: all visible cores")),
                    }
                ),
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


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )


def _spec_name(spec: Any) -> str:
    if isinstance(spec, (Opt, Range)):
        return _spec_name(spec.spec)
    if spec is NUMBER:
        return "number"
    if spec is RATIO:
        return "scale factor (number or 'a/b')"
    if spec is DURATION:
        return "seconds or a duration ('2h', '1-12:00:00')"
    if isinstance(spec, OneOf):
        return "one of " + ", ".join(spec.choices)
    if isinstance(spec, (dict, MapOf)):
        return "mapping"
    if isinstance(spec, ListOf):
        return "list"
    return getattr(spec, "__name__", str(spec))


def seconds(value: Any, where: str) -> int:
    """Seconds from a :data:`DURATION` value: an int as it is (checked where it is used: 0 means "no
    warning" for ``warn_before_limit``), text as a duration."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected seconds or a duration, got {type_name(value)}")
    try:
        return parse_duration(value)
    except OpenlabError as exc:
        raise ConfigError(f"{where}: {exc}") from None


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
    except (ValueError, ZeroDivisionError, OverflowError):  # inf: "cannot convert Infinity to integer ratio"
        raise ConfigError(
            f"{where}: expected a scale factor (number or 'a/b'), got {type_name(value)} {value!r}"
        ) from None
    if frac <= 0:
        raise ConfigError(f"{where}: scale factor must be positive, got {value!r}")
    if frac > 10**6:  # 1e300 overflowed a float in the scaled values: a replica is a scale *down*, or near it
        raise ConfigError(f"{where}: scale factor must be at most 1000000, got {value!r}")
    return frac


def check_schema(value: Any, spec: Any, path: str, where: str) -> None:
    """Validate ``value`` against ``spec``; raise :class:`ConfigError` naming the key path."""
    label = f"{where}: {path}" if path else where
    if isinstance(spec, Opt):
        if value is None and spec.nullable:
            return
        check_schema(value, spec.spec, path, where)
        return
    if spec is object:
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{label}: expected mapping, got {type_name(value)}")
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
            check_schema(value[key], sub, sub_path, where)
        return
    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            raise ConfigError(f"{label}: expected mapping, got {type_name(value)}")
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{label}: keys must be strings, got {key!r}")
            check_schema(item, spec.spec, f"{path}.{key}" if path else key, where)
        return
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            raise ConfigError(f"{label}: expected list, got {type_name(value)}")
        for i, item in enumerate(value):
            check_schema(item, spec.spec, f"{path}[{i}]", where)
        return
    if isinstance(spec, OneOf):
        if not isinstance(value, str) or value not in spec.choices:
            raise ConfigError(f"{label}: got {value!r}; {choices(value, spec.choices, label='expected one of')}")
        return
    if isinstance(spec, Range):
        check_schema(value, spec.spec, path, where)
        if not spec.holds(value):
            what = f" ({spec.what})" if spec.what else ""
            raise ConfigError(f"{label}: must be {spec.allowed()}{what}, got {value!r}")
        return
    if spec is RATIO:
        parse_ratio(value, label)
        return
    if spec is DURATION:
        seconds(value, label)
        return
    if spec is NUMBER:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{label}: expected number, got {type_name(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{label}: expected a finite number, got {value!r}")
        return
    if spec is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label}: expected int, got {type_name(value)}")
        return
    if spec is str:
        if not isinstance(value, str):
            raise ConfigError(f"{label}: expected str, got {type_name(value)}")
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


def get_dotted(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def put_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
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
    check_schema(value, spec, label, where)


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
# YAML 1.2's integers only: PyYAML's 1.1 rules read `010` as 8 and `1:30` as 90 (base 60), values a
# recipe then ran with, unsaid. Such text stays text, which the schema refuses as not a number.
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in YamlLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)


def _no_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """A mapping whose keys are each given once: a second `train:` replaced the first, every value
    in it lost without a word."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"found the key {key!r} twice in one mapping; keep one", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


YamlLoader.add_constructor("tag:yaml.org,2002:map", _no_duplicate_keys)


def load_yaml(text: str) -> Any:
    """``text`` read as YAML by :class:`YamlLoader` (safe: no arbitrary objects)."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass
