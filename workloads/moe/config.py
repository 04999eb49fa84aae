"""Stage configuration: one schema shared by every stage, loaded from YAML or JSON.

Every stage (`data`, `tokenize`, `pretrain`, `midtrain`, `posttrain`, `eval`, `repro`) reads the same
schema and uses the sections it needs; the Flows engineer generates these files from recipes, so the
schema is deliberately flat and stable. All sections are optional and have defaults, except the
`inputs` a stage needs. Unknown keys are errors (with their key path) so a typo never silently
falls back to a default.

    seed: 0                      # seeds data split, sampling, init
    device: auto                 # auto | cpu | cuda
    threads: 0                   # torch CPU threads; 0 = all visible cores
    inputs:                      # paths produced by earlier stages
      corpus: DIR                # `data` output        (tokenize)
      tokens: DIR                # `tokenize` output    (pretrain, midtrain, posttrain, eval, repro)
      checkpoint: DIR            # a training stage out  (midtrain, posttrain, eval)
    data:                        # stage `data`
      domains: {code: "stdlib:code", prose: "stdlib:docstrings"}   # or "licenses", "path:/dir/*.txt"
      max_bytes_per_domain: 4000000
      heldout_fraction: 0.05
    tokenizer: {vocab_size: 8192, min_frequency: 2}                  # stage `tokenize`
    model:                       # architecture (pretrain/repro; later stages take it from the checkpoint)
      d_model: 512, n_layers: 8, n_heads: 8, context: 4096, attn_window: 0,
      n_experts: 24, top_k: 4, expert_hidden: 256, n_shared: 1, shared_hidden: 512, routed_weight_sum: 2.5
    moe:                         # expert-parallel dispatch simulated in one process + balancing
      dispatch: dropless         # dropless | fixed_all_to_all | pooled_wave | ragged | waterfilling
      ranks: 4                   # EP degree P; whole sequences per rank; experts split across ranks
      capacity_factor: 1.0       # cf (receiver cf for pooled_wave)
      transport_capacity_factor: 1.05   # tcf, pooled_wave sender gate
      waves: 3                   # W, pooled_wave
      chunks: 2                  # ragged
      qb: true                   # quantile-balancing bias update
      qb_estimator: topk         # topk (per rank q-th largest margin, averaged; Marin's default) | hist
      qb_hist_bins: 10000        # hist: global histogram bins (the hero's estimator, 10,000 bins)
      aux_loss_coef: 0.0         # load-balancing loss coefficient (Marin: 0)
      z_loss_coef: 0.0           # router z-loss coefficient (Marin: 0)
    train:                       # pretrain / midtrain / posttrain / repro
      steps: 100, batch_size: 16, lr: 0.003, min_lr_ratio: 0.1, warmup_steps: 10,
      weight_decay: 0.1, grad_clip: 1.0, mixture: {code: 0.5, prose: 0.5},
      checkpoint_every: 50, stop_after: 0,  # stop_after>0 simulates preemption after that step
      keep_every: 0              # >0: also keep every N-th step's checkpoint, never rewritten
                                 # (checkpoint/revisions/step-NNNNNN.pt, listed with tokens seen)
    eval: {batches: 8, batch_size: 16}      # stage `eval` (held-out loss per domain + routing metrics)
    repro:                       # stage `repro`: one trained router, every arm measured every step
      train_arm: pooled_wave_1.05_1.33    # the arm whose dispatch is in the training forward pass
      late_window: 40                    # report the median over the last N steps
      early_steps: []                    # also report the median over these steps (1-based, as logged;
                                         # e.g. [25], Marin's step-25 scoring point); [] = none
      transient_steps: []                # also measure these steps, each reported on its own (how drops
                                         # fall from init; Marin #8317's ragged transient); [] = none
      measure_batch_size: 0              # sequences per measured batch (0 = the training batch); >0 = a
                                         # separate batch of distinct windows, forward-only, in the window
      scale_capacity: true               # arms give Marin's cf; scaled so (cf-1)*sqrt(mu) is kept
      arms: [{name, dispatch, capacity_factor, transport_capacity_factor, waves, chunks, marin_drop,
              marin_early_drop, scale}]   # scale: per-arm override of scale_capacity (false = Marin's cf as is)
    wandb: {id, project, entity, group, job_type, tags, config, resume: allow}   # absent = disabled
    extends: OTHER.yaml          # optional: start from that file (relative to this one), then merge
                                 # this file's keys on top (mappings key by key, lists replaced whole)

Why a single schema: the stages form one chain and the flows layer can write the same `model`/`moe`
sections everywhere; the training stages fail fast if a `model` section disagrees with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES = ("data", "tokenize", "pretrain", "midtrain", "posttrain", "eval", "repro")
DISPATCH_NAMES = ("dropless", "fixed_all_to_all", "pooled_wave", "ragged", "waterfilling")
# QB beta estimators (marin-moe.md section 1): per-rank top-k averaged (model default), global histogram (hero)
QB_ESTIMATORS = ("topk", "hist")


class WorkloadError(Exception):
    """A user-facing error (bad config or input). The CLI prints it as one line and exits 2."""


class ConfigError(WorkloadError):
    """The config file is malformed or inconsistent; raised before any compute."""


def known_names(name: object, names: Sequence[str]) -> str:
    """``(did you mean 'n_experts'? known: ...)`` after an unknown name, or the known names alone
    when none is close. The workload's own copy of openlab's wording: it imports nothing of openlab."""
    close = difflib.get_close_matches(str(name), list(names), n=1)
    listed = f"known: {', '.join(names)}"
    return f"(did you mean {close[0]!r}? {listed})" if close else f"({listed})"


@dataclass
class InputsConfig:
    corpus: str | None = None
    tokens: str | None = None
    checkpoint: str | None = None


@dataclass
class DataConfig:
    domains: dict[str, str] = field(default_factory=lambda: {"code": "stdlib:code", "prose": "stdlib:docstrings"})
    max_bytes_per_domain: int = 4_000_000
    heldout_fraction: float = 0.05
    min_doc_chars: int = 64
    max_sft_examples: int = 20_000


@dataclass
class TokenizerConfig:
    vocab_size: int = 8192
    min_frequency: int = 2


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0 = take it from the tokenizer
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    context: int = 4096
    attn_window: int = 0  # 0 = full causal attention; >0 = sliding window (Marin: 2048)
    n_experts: int = 24
    top_k: int = 4
    expert_hidden: int = 256
    n_shared: int = 1
    shared_hidden: int = 512
    routed_weight_sum: float = 2.5
    rope_theta: float = 10_000.0


@dataclass
class MoEConfig:
    dispatch: str = "dropless"
    ranks: int = 4
    capacity_factor: float = 1.0
    transport_capacity_factor: float = 1.05
    waves: int = 3
    chunks: int = 2
    qb: bool = True
    qb_estimator: str = "topk"
    qb_hist_bins: int = 10000
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mixture: dict[str, float] = field(default_factory=dict)  # empty = uniform over domains
    checkpoint_every: int = 50
    stop_after: int = 0
    #: Keep every N-th step's checkpoint as an immutable revision (0: only the latest, rewritten).
    keep_every: int = 0


@dataclass
class EvalConfig:
    batches: int = 8
    batch_size: int = 16


@dataclass
class ArmConfig:
    name: str = ""
    dispatch: str = "fixed_all_to_all"
    capacity_factor: float = 1.0
    transport_capacity_factor: float = 1.05
    waves: int = 3
    chunks: int = 2
    marin_drop: float | None = None  # Marin's published drop fraction (for the report table)
    marin_early_drop: float | None = None  # Marin's figure at its early scoring point (step 25), if any
    scale: bool | None = None  # override repro.scale_capacity for this arm (false = Marin's cf as is)


@dataclass
class ReproConfig:
    train_arm: str = ""
    late_window: int = 40
    # Sequences in each measured step's batch, split evenly over moe.ranks (whole sequences). 0 = measure
    # on the training batch at every step. >0 = in the late window (and the step before it, so the QB bias
    # of the first reported step already comes from a batch of this size) a separate batch of
    # non-overlapping windows goes through a forward pass without gradients, with the current weights and
    # QB bias; its routing is what every arm dispatches and its QB beta is the next step's bias.
    measure_batch_size: int = 0
    # Steps (1-based, as logged) whose median is reported as the early window, beside the late window;
    # e.g. [25], the final step of Marin's 25-step gates (#7279, #8320). Each is measured like the late
    # window, and so is the step before each (not reported), so its QB bias comes from a batch of
    # measure_batch_size sequences. [] = no early window.
    early_steps: list[int] = field(default_factory=list)
    # Steps measured the same way (each with the step before it) and reported one by one, not as a
    # median: the balancing transient from init, to set beside Marin's (#8317: a ragged cf 1.15 run
    # peaks near 24% at step ~11 and is under 2% by step ~54). [] = none.
    transient_steps: list[int] = field(default_factory=list)
    scale_capacity: bool = True
    arms: list[ArmConfig] = field(default_factory=list)


@dataclass
class Config:
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    inputs: InputsConfig = field(default_factory=InputsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    repro: ReproConfig = field(default_factory=ReproConfig)
    wandb: dict[str, Any] | None = None
    # Which top-level sections the file actually gave (so stages can tell "absent" from "default").
    given: tuple[str, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("given")
        return d


# --------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Convert a parsed YAML/JSON value to the annotated type, or raise ConfigError naming the path."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config: '{path}' must be a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"config: '{path}' must be a mapping, got {type(value).__name__}")
        return {_coerce(kt, k, f"{path}.{k}"): _coerce(vt, v, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        (it,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config: '{path}' must be a list, got {type(value).__name__}")
        return [_coerce(it, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config: '{path}' must be true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config: '{path}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config: '{path}' must be a number, got {value!r}")
        if not math.isfinite(value):  # a NaN learning rate trained to `loss nan`; an inf factor overflowed
            raise ConfigError(f"config: '{path}' must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config: '{path}' must be a string, got {value!r}")
        return value
    raise ConfigError(f"config: '{path}': unsupported type {_type_name(tp)}")  # pragma: no cover


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "given"]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"config: unknown key '{full}' {known_names(key, names)}")
        kwargs[key] = _coerce(hints[key], value, full)
    return cls(**kwargs)


def parse_config(data: dict[str, Any]) -> Config:
    """Build a Config from a plain dict; raises ConfigError on unknown keys or wrong types."""
    if not isinstance(data, dict):
        raise ConfigError("config: the top level must be a mapping")
    cfg = _build(Config, data, "")
    cfg.given = tuple(data.keys())
    return cfg


def load_yaml(text: str) -> Any:
    """``text`` read as safe YAML, ``1e-4`` a number as YAML 1.2 reads it (PyYAML's 1.1 rules make it
    the text "1e-4", and ``--set train.lr=1e-4`` was refused). The orchestrator reads its recipes
    the same way (its own copy: the workload imports nothing of it)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    # YAML 1.2's integers only (`010` is not 8, `1:30` not 90), and no key given twice (a second `train:`
    # replaced the first): as the orchestrator's loader reads recipes
    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
        for first, resolvers in Loader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:int",
        re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0o[0-7]+|0x[0-9a-fA-F]+)$"),
        list("-+0123456789"),
    )

    def no_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found the key {key!r} twice in one mapping; keep one", key_node.start_mark
                )
            seen.add(key)
        return loader.construct_mapping(node)

    Loader.add_constructor("tag:yaml.org,2002:map", no_duplicate_keys)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``dotted.key=VALUE`` set (VALUE read as YAML: ``3``, ``0.5``, ``[1, 2]``, ``{a: 1}``).

    Why: a variant of a recipe that differs in one knob (a seed, an output path) is then one
    flag instead of a copy of the file that drifts from its original.
    """
    import yaml

    out = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted KEY, e.g. --set train.steps=20")
        try:
            value = load_yaml(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: cannot read the value: {str(exc).splitlines()[0]}") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on top: mappings merge key by key, anything else (a list of arms, a
    number) is replaced whole."""
    out = json.loads(json.dumps(base))
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The plain data of a config file, with ``extends: OTHER.yaml`` (a path relative to the file)
    resolved: the other file first, then this one's keys on top (:func:`merge_config`).

    Why: a variant of a recipe (another corpus, another P) is then its differences and nothing
    else, so it cannot drift from the recipe it varies when that recipe changes.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}" + (f" (extended by {_chain[-1]})" if _chain else ""))
    if p.resolve() in _chain:
        loop = " -> ".join(str(c.name) for c in (*_chain, p.resolve()))
        raise ConfigError(f"config: extends loops back on itself: {loop}")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            data = load_yaml(text)
    except Exception as exc:  # parse errors become one line
        msg = str(exc).replace("\n", " ")
        raise ConfigError(f"config: cannot parse {p}: {msg}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {p}: the top level must be a mapping")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"config: {p}: extends: expected the path of another config file, got {parent!r}")
    return merge_config(read_config_file(p.parent / parent, (*_chain, p.resolve())), data)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML or JSON config file (by suffix; YAML is tried for anything but .json) and the files
    it ``extends``, then apply ``overrides`` (``dotted.key=VALUE``, see :func:`apply_overrides`)."""
    return parse_config(apply_overrides(read_config_file(path), overrides))


# --------------------------------------------------------------------------- validation

_STAGE_INPUTS = {
    "data": (),
    "tokenize": ("corpus",),
    "pretrain": ("tokens",),
    "midtrain": ("tokens", "checkpoint"),
    "posttrain": ("tokens", "checkpoint"),
    "eval": ("tokens", "checkpoint"),
    "repro": ("tokens",),
}


#: The largest capacity factor taken: a factor is slots per expected assignment, and past the number of
#: experts every assignment fits anyway; 1e300 overflowed converting the capacity to an integer.
MAX_CAPACITY_FACTOR = 1000.0


def validate_dispatch(dispatch: str, cf: float, tcf: float, waves: int, chunks: int, where: str) -> None:
    if dispatch not in DISPATCH_NAMES:
        raise ConfigError(
            f"config: {where}.dispatch: unknown dispatch '{dispatch}' {known_names(dispatch, DISPATCH_NAMES)}"
        )
    if not (0 < cf <= MAX_CAPACITY_FACTOR and 0 < tcf <= MAX_CAPACITY_FACTOR):  # 1e300 overflowed at dispatch
        raise ConfigError(f"config: {where}: capacity factors must be > 0 and at most {MAX_CAPACITY_FACTOR:g}")
    if waves < 1 or chunks < 1:
        raise ConfigError(f"config: {where}: waves and chunks must be >= 1")


def validate_model(m: ModelConfig, ranks: int) -> None:
    """Architecture checks shared by pretrain and checkpoint-loading stages."""
    for name in ("d_model", "n_layers", "n_heads", "context", "n_experts", "top_k", "expert_hidden"):
        if getattr(m, name) < 1:
            raise ConfigError(f"config: model.{name} must be >= 1, got {getattr(m, name)}")
    if m.top_k >= m.n_experts:
        raise ConfigError(
            f"config: model.top_k={m.top_k} must be < model.n_experts={m.n_experts} "
            "(routing takes the top-(K+1) biased scores)"
        )
    if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"config: model.d_model={m.d_model} must split into n_heads={m.n_heads} heads of even width")
    if ranks < 1 or m.n_experts % ranks:
        raise ConfigError(
            f"config: model.n_experts={m.n_experts} is not divisible by moe.ranks={ranks} "
            "(experts are split evenly across EP ranks)"
        )
    if m.n_shared < 0 or (m.n_shared and m.shared_hidden < 1):
        raise ConfigError("config: model.n_shared must be >= 0 and model.shared_hidden >= 1")


def validate(cfg: Config, stage: str) -> None:
    """Check everything that can be checked without touching data; raise ConfigError with one line."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage '{stage}' {known_names(stage, STAGES)}")
    for name in _STAGE_INPUTS[stage]:
        if not getattr(cfg.inputs, name):
            raise ConfigError(f"config: stage '{stage}' needs inputs.{name}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"config: device must be auto, cpu or cuda, got '{cfg.device}'")
    if cfg.seed < 0:
        raise ConfigError(f"config: seed must be >= 0, got {cfg.seed}")
    mo = cfg.moe
    if mo.ranks < 1:  # every stage splits by it (a data stage divided by 0)
        raise ConfigError(f"config: moe.ranks must be >= 1, got {mo.ranks}")
    tr = cfg.train
    for name, ok, rule in (
        ("train.lr", tr.lr >= 0, ">= 0 (0: the parameters stay as they are)"),
        ("train.min_lr_ratio", 0 <= tr.min_lr_ratio <= 1, "in [0, 1]"),
        ("train.weight_decay", tr.weight_decay >= 0, ">= 0"),
        ("train.grad_clip", tr.grad_clip >= 0, ">= 0 (0: no clipping)"),
        ("model.attn_window", cfg.model.attn_window >= 0, ">= 0 (0: full causal attention)"),
        ("model.rope_theta", cfg.model.rope_theta > 0, "> 0"),
        ("model.routed_weight_sum", cfg.model.routed_weight_sum > 0, "> 0"),
        ("eval.batches", cfg.eval.batches >= 1, ">= 1"),
        ("tokenizer.min_frequency", cfg.tokenizer.min_frequency >= 0, ">= 0"),
        ("tokenizer.vocab_size", cfg.tokenizer.vocab_size <= 2**31 - 1, "at most 2147483647"),
        ("data.max_bytes_per_domain", cfg.data.max_bytes_per_domain >= 1, ">= 1"),
        ("data.min_doc_chars", cfg.data.min_doc_chars >= 0, ">= 0"),
    ):
        if not ok:  # each trained on (a flipped gradient, a negative learning rate) or crashed in torch
            raise ConfigError(f"config: {name} must be {rule}")
    bad_domain = next(
        (d for d in cfg.data.domains if not re.fullmatch(r"[A-Za-z0-9_.-]+", d) or d in (".", "..")), None
    )
    if bad_domain is not None:  # a name is a folder under the output: "../x" wrote outside it
        raise ConfigError(f"config: data.domains: {bad_domain!r} is no name for a domain; use letters, digits, _ . -")
    validate_dispatch(mo.dispatch, mo.capacity_factor, mo.transport_capacity_factor, mo.waves, mo.chunks, "moe")
    if mo.qb_estimator not in QB_ESTIMATORS:
        raise ConfigError(f"config: moe.qb_estimator '{mo.qb_estimator}' is not one of {', '.join(QB_ESTIMATORS)}")
    if mo.qb_hist_bins < 2:
        raise ConfigError(f"config: moe.qb_hist_bins={mo.qb_hist_bins} must be at least 2")
    if stage in ("pretrain", "repro") or "model" in cfg.given:
        validate_model(cfg.model, mo.ranks)
    if cfg.train.batch_size < 1 or cfg.train.batch_size % mo.ranks:
        raise ConfigError(
            f"config: train.batch_size={cfg.train.batch_size} must be a positive multiple of "
            f"moe.ranks={mo.ranks} (each rank holds whole sequences)"
        )
    if cfg.eval.batch_size < 1 or cfg.eval.batch_size % mo.ranks:
        raise ConfigError(
            f"config: eval.batch_size={cfg.eval.batch_size} must be a positive multiple of moe.ranks={mo.ranks}"
        )
    if cfg.train.steps < 1 or cfg.train.checkpoint_every < 1:
        raise ConfigError("config: train.steps and train.checkpoint_every must be >= 1")
    if cfg.train.keep_every < 0:
        raise ConfigError("config: train.keep_every must be >= 0 (0 keeps only the latest checkpoint)")
    weights = cfg.train.mixture.values()
    if any(w < 0 for w in weights) or (cfg.train.mixture and not 0 < sum(weights) < math.inf):
        raise ConfigError("config: train.mixture weights must be >= 0, not all zero, and sum to a finite number")
    if not 0 < cfg.data.heldout_fraction < 1:
        raise ConfigError("config: data.heldout_fraction must be in (0, 1)")
    if cfg.tokenizer.vocab_size < 300:
        raise ConfigError("config: tokenizer.vocab_size must be >= 300 (256 bytes + merges + specials)")
    if stage == "repro":
        rp = cfg.repro
        if cfg.train.keep_every:
            raise ConfigError(
                "config: train.keep_every is for pretrain, midtrain and posttrain; repro keeps its latest"
            )
        if not rp.arms:
            raise ConfigError("config: stage 'repro' needs repro.arms")
        names = [a.name for a in rp.arms]
        if len(set(names)) != len(names) or not all(names):
            raise ConfigError("config: repro.arms need unique, non-empty names")
        for i, a in enumerate(rp.arms):
            validate_dispatch(
                a.dispatch, a.capacity_factor, a.transport_capacity_factor, a.waves, a.chunks, f"repro.arms[{i}]"
            )
        if rp.train_arm and rp.train_arm not in names:
            raise ConfigError(f"config: repro.train_arm '{rp.train_arm}' is not one of repro.arms ({names})")
        if rp.late_window < 1 or rp.late_window > cfg.train.steps:
            raise ConfigError("config: repro.late_window must be in [1, train.steps]")
        for key in ("early_steps", "transient_steps"):
            steps = getattr(rp, key)
            if any(s < 1 or s > cfg.train.steps for s in steps) or len(set(steps)) != len(steps):
                raise ConfigError(f"config: repro.{key} must be distinct steps in [1, train.steps]")
        if rp.measure_batch_size < 0 or rp.measure_batch_size % mo.ranks:
            raise ConfigError(
                f"config: repro.measure_batch_size={rp.measure_batch_size} must be 0 or a positive multiple of "
                f"moe.ranks={mo.ranks} (each rank holds whole sequences)"
            )
