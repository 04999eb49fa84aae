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

from orchestrator.recipes.overrides import (
    MAX_TRIALS,
    Sampler,
    Sampling,
    parse_grid,
    parse_sample,
    parse_samples,
    parse_sets,
    set_value_word,
    set_words,
    split_item,
    sweep_trials,
)
from orchestrator.recipes.recipe import (
    RECIPES_DIR,
    Recipe,
    ResolvedRecipe,
    TrackedMetric,
    find_recipe,
    identity_config,
    load_recipe,
    parse_recipe,
    resolve,
    stage_resources,
    validate_workload_configs,
)
from orchestrator.recipes.schema import (
    BACKEND_OPTIONS,
    DEFAULT_STAGES,
    RECIPE_SCHEMA,
    SCALE_RULES,
    STAGES,
    TRAINING_STAGES,
    YamlLoader,
    check_set,
    load_yaml,
    settable_fields,
)

__all__ = [
    "BACKEND_OPTIONS",
    "DEFAULT_STAGES",
    "MAX_TRIALS",
    "RECIPES_DIR",
    "RECIPE_SCHEMA",
    "SCALE_RULES",
    "STAGES",
    "TRAINING_STAGES",
    "Recipe",
    "ResolvedRecipe",
    "Sampler",
    "Sampling",
    "TrackedMetric",
    "YamlLoader",
    "check_set",
    "find_recipe",
    "identity_config",
    "load_recipe",
    "load_yaml",
    "parse_grid",
    "parse_recipe",
    "parse_sample",
    "parse_samples",
    "parse_sets",
    "resolve",
    "set_value_word",
    "set_words",
    "settable_fields",
    "split_item",
    "stage_resources",
    "sweep_trials",
    "validate_workload_configs",
]
