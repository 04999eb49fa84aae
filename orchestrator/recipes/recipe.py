"""Loading a recipe file and resolving a replica of it into per-stage workload configs.

:func:`find_recipe` / :func:`load_recipe` read ``recipes/NAME.yaml`` and check it against
:data:`~orchestrator.recipes.schema.RECIPE_SCHEMA`; :func:`resolve` applies a replica's scale
factors (:data:`~orchestrator.recipes.schema.SCALE_RULES`), its ``set`` values and the run's own,
and turns the result into concrete configs in the MoE workload's schema, validated by the
workload's own checks before any job starts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import ConfigError, OpenlabError, choices
from orchestrator.hashing import hash_json
from orchestrator.launchers.base import parse_memory, parse_memory_request
from orchestrator.preregistration import Prediction
from orchestrator.recipes.schema import (
    BACKEND_OPTIONS,
    DEFAULT_STAGES,
    DURATION_KEYS,
    RECIPE_SCHEMA,
    RUNTIME_KEYS,
    SCALE_RULES,
    TRAINING_STAGES,
    check_schema,
    check_set,
    get_dotted,
    load_yaml,
    parse_ratio,
    put_dotted,
    seconds,
    type_name,
)
from orchestrator.settings import expand_user
from orchestrator.tolerances import check_metric, parse_tolerances

#: Where recipe names (``marin-535b-a23b``) are looked up: ``recipes/`` at the repo root.
RECIPES_DIR = Path(__file__).resolve().parent.parent.parent / "recipes"


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
    #: Which way is a regression (``higher``: a loss, ``lower``: an accuracy); ``either`` flags any change,
    #: and an improvement beyond the tolerance then fails every later nightly against the old baseline.
    worse: str = "either"

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
    candidate = expand_user(ref)
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


def shipped_names(folder: Path | None = None) -> tuple[set[str], set[str]]:
    """The names of the recipes in ``folder`` (``recipes/``) that have replicas, and of their
    replicas: what a filter naming a recipe or replica may name before any run recorded it. Read
    as plain YAML, unchecked: a recipe that does not load names nothing here."""
    recipes: set[str] = set()
    replicas: set[str] = set()
    for path in sorted((folder or RECIPES_DIR).glob("*.yaml")):
        try:
            data = load_yaml(path.read_text(encoding="utf-8"))
        except Exception:  # noqa: BLE001 - see above
            continue
        if isinstance(data, dict) and isinstance(data.get("replicas"), dict):
            recipes.add(path.stem)
            replicas |= {str(name) for name in data["replicas"]}
    return recipes, replicas


def load_recipe(ref: str | Path, recipes_dir: Path | None = None, *, root: Path | None = None) -> Recipe:
    """Read and validate a recipe (:func:`load_yaml`: no arbitrary objects from YAML)."""
    path = find_recipe(ref, recipes_dir, root=root)
    where = f"recipe {path.name}"
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); save the file as UTF-8"
        ) from None
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
        raise ConfigError(f"{where}: the top level must be a mapping, got {type_name(data)}")
    check_schema(data, RECIPE_SCHEMA, "", where)
    check_values(data, where)
    parse_tolerances(data.get("tracked_metrics") or {}, f"{where}: tracked_metrics")  # the verdict's own rules
    for rname, replica in (data.get("replicas") or {}).items():
        for dotted, value in (replica.get("set") or {}).items():
            check_set(dotted, value, f"replicas.{rname}.set.{dotted}", where)
    return Recipe(name=data["name"], path=path.resolve(), data=data, content_hash=hash_json(data))


def _scaled(value: Any, factor: Fraction, path: str) -> Any:
    """``value`` times ``factor``: a count stays at least 1, and 0 stays 0 (no shared experts, full
    attention: a scale does not turn "none" into one)."""
    if value is None:
        return None
    if isinstance(value, int):
        return max(1, int(round(Fraction(value) * factor))) if value else 0
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
                current = get_dotted(values, dotted)
                if current is not None:
                    put_dotted(values, dotted, _scaled(current, factor, dotted))
        for dotted, value in (spec.get("set") or {}).items():
            overrides[dotted] = value
            put_dotted(values, dotted, value)
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
            put_dotted(repro, dotted[len("repro.") :], value)
        else:
            put_dotted(values, dotted, value)
    check_values(values, where, repro, stages)  # what the sets left must still hang together
    source = recipe.replicas[replica] if replica is not None else recipe.data
    predicted = source.get("preregistered") or {}
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
            worse=m.get("worse") or "either",
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
    asked = {  # time_limit: "2-00:00:00" as a Slurm user writes it, kept as the seconds a job asks for
        name: {**entry, **{k: seconds(entry[k], f"{where}.{name}.{k}") for k in DURATION_KEYS if k in entry}}
        for name, entry in asked.items()
    }
    for name, entry in asked.items():  # cpus, gpus, nodes ...: their ranges are the schema's
        label = f"{where}.{name}"
        if "time_limit" in entry and entry["time_limit"] <= 0:
            raise ConfigError(f"{label}.time_limit: seconds, must be positive, got {entry['time_limit']!r}")

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
        if entry.get("memory") is not None:
            try:
                parse_memory_request(entry["memory"])
            except OpenlabError as exc:
                raise ConfigError(f"{label}.memory: {exc}") from None
        if extra := (entry.get("slurm") or {}).get("extra_args"):  # refused here, not once a job is submitted
            from orchestrator.launchers.slurm import refuse_own_flags

            try:
                refuse_own_flags(extra)
            except ConfigError as exc:
                raise ConfigError(f"{label}.slurm.{exc}") from None
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
        warn, limit = merged.get("warn_before_limit"), merged.get("time_limit")
        if warn and not limit:
            source = stage if "warn_before_limit" in own else "default"
            raise ConfigError(
                f"{where}.{source}.warn_before_limit: stage {stage} has no time_limit to be warned ahead of; "
                "give it one, or leave this out"
            )
        if warn is not None and (warn < 0 or (warn and warn >= limit)):
            source = stage if "warn_before_limit" in own else "default"
            raise ConfigError(
                f"{where}.{source}.warn_before_limit: seconds ahead of the stage's time_limit ({limit}), "
                f"so 0 (no warning) or under it, got {warn!r}"
            )
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
        "checkpoint_every": min(int(section["checkpoint_every"]), steps),  # 1 or more: the schema's range
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
