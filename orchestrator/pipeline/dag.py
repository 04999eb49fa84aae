"""The stage DAG: which stages exist, what each consumes, and which code and environment decide it.

A :class:`Pipeline` is plain data — stage names, inputs, declared code paths, declared
environment fields and a command template — built at call time, never at import time
(Marin #6649: a graph built on import silently forked outputs when files changed).
The repository root is a field, so tests can point the same machinery at a scratch git
repository whose stage programs are small scripts.

Declared code paths are what a stage's identity hashes (their working-tree git tree
hashes): a one-line edit to a declared path re-runs that stage, an edit anywhere else
does not. Declared environment fields are taken from the captured environment
(``python_version``, ``packages_hash``, ...) or, written ``pkg:NAME``, the installed
version of one distribution — so installing an unrelated package does not re-run
training, while upgrading torch does.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, choices
from orchestrator.launchers.base import DEFAULT_PYTHON
from orchestrator.recipes.schema import DEFAULT_STAGES, TRAINING_STAGES
from orchestrator.settings import Settings

#: Where this repository lives (the MoE workload's stage programs are under it).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Files whose content may differ between two runs that computed the same thing (wall
#: times in metrics and in the per-step log, W&B run folders, logs). Downstream identities hash a stage's output
#: *without* them, so a re-run that produced byte-identical data re-uses what follows.
DEFAULT_VOLATILE = ("metrics.json", "metrics.jsonl", "wandb/*", "wandb_run_id", "*.log", "*.tmp", ".openlab/*")


@dataclass(frozen=True)
class StageSpec:
    """One stage: its name, its inputs and what decides its result.

    ``inputs`` maps the config key the stage reads (``inputs.tokens`` in its config) to
    the upstream stage whose output folder it is. ``command`` is a template: ``{python}``,
    ``{stage}``, ``{config}`` and ``{out}`` are substituted at launch.
    """

    name: str
    inputs: Mapping[str, str] = field(default_factory=dict)
    code_paths: tuple[str, ...] = ()
    environment_fields: tuple[str, ...] = ()
    command: tuple[str, ...] = ("{python}", "-m", "workloads.moe", "{stage}", "--config", "{config}", "--out", "{out}")
    #: The stage's output folder is also recorded as a DataSnapshot (the corpus).
    snapshot_output: bool = False
    volatile: tuple[str, ...] = DEFAULT_VOLATILE
    #: The stage's program opens a W&B run when its config has a ``wandb:`` section. Only such
    #: stages get the section and have their W&B run read back into lineage: a stage that never
    #: calls ``wandb.init`` (data, tokenize) has no run to record, and looking for one would
    #: warn on every run about a failure that did not happen.
    tracks_wandb: bool = False
    #: Job resources (local backend ignores most of them).
    cpus: float | None = None
    memory: str | None = None
    gpus: int = 0
    time_limit: int | None = None
    #: Several processes of one job (a training stage trains data-parallel over them; several nodes on
    #: Slurm and Kubernetes, one machine on local and Docker).
    nodes: int = 1
    tasks_per_node: int = 1
    #: Backend-specific job options by backend name (``{"slurm": {"partition": "gpu"}}``), passed
    #: to the launcher as ``JobSpec.options`` when the stage runs on that backend.
    backend_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: The backend this stage's job runs on (data prep on local, training on Slurm); None: the run's.
    backend: str | None = None
    #: The file, in the output folder, a resumable stage saves its progress to. Such a stage is sent
    #: SIGUSR1 ahead of its time limit, on which it must save and stop; a job of it stopped by the
    #: warning, or by the limit itself after writing the file anew, made progress a next attempt
    #: resumes from, so the stage goes on as after a preemption: a cluster's wall-time cap cuts a
    #: long training into jobs instead of failing it (:mod:`orchestrator.pipeline.checkpoints`).
    checkpoint: str | None = None
    #: Seconds ahead of ``time_limit`` the warning comes (0: none); None: the default of
    #: :func:`orchestrator.pipeline.checkpoints.warn_before_limit`.
    warn_before_limit: int | None = None

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node

    def render_command(self, *, python: str, config: Path, out: Path) -> list[str]:
        values = {"python": python, "stage": self.name, "config": str(config), "out": str(out)}
        return [part.format(**values) for part in self.command]


@dataclass(frozen=True)
class Pipeline:
    """A DAG of stages rooted in one repository; ``order`` is a topological order."""

    name: str
    stages: tuple[StageSpec, ...]
    repo_root: Path = REPO_ROOT
    image: str | None = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for spec in self.stages:
            if spec.name in seen:
                raise ConfigError(f"pipeline {self.name}: stage {spec.name!r} defined twice")
            for key, upstream in spec.inputs.items():
                if upstream not in seen:
                    raise ConfigError(
                        f"pipeline {self.name}: stage {spec.name!r} input {key!r} names {upstream!r}, "
                        "which is not an earlier stage"
                    )
            seen.add(spec.name)

    @property
    def order(self) -> list[str]:
        return [s.name for s in self.stages]

    def stage(self, name: str) -> StageSpec:
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise ConfigError(f"pipeline {self.name}: no stage {name!r}; {choices(name, self.order, label='stages')}")

    def check_forced(self, force: bool | frozenset[str]) -> None:
        """Refuse a forced stage this pipeline does not have: a typo in ``--force-stage`` would
        otherwise reuse the stage the user meant to re-run, and say nothing."""
        if isinstance(force, bool):
            return
        unknown = sorted(set(force) - set(self.order))
        if unknown and unknown[0] in MOE_STAGE_INPUTS:  # a stage there is, that this run leaves out
            raise ConfigError(
                f"--force-stage {unknown[0]!r}: this run does not run it (an --until before it, or a replica "
                f"without it); it runs {', '.join(self.order)}"
            )
        if unknown:
            hint = choices(unknown[0], self.order, label="stages")
            raise ConfigError(f"--force-stage {unknown[0]!r}: no such stage in pipeline {self.name}; {hint}")

    def code_paths(self) -> list[str]:
        """Every declared code path of every stage (captured once per pipeline run)."""
        out: list[str] = []
        for spec in self.stages:
            out.extend(p for p in spec.code_paths if p not in out)
        return out

    def code_tree(self, tree_hashes: Mapping[str, str], why: str | None = None) -> dict[str, str]:
        """The git id of every stage's declared code (``tree_hashes`` of the capture), refused in one
        line where the capture has none: without git (a copy of the project with no ``.git``, no
        ``git`` on PATH) there is nothing to put in a stage's identity, which was a KeyError out of
        ``run``, ``explain`` and ``adopt`` after ``run`` had recorded its pipeline run as FAILED."""
        missing = [p for p in self.code_paths() if p not in tree_hashes]
        if missing:
            from orchestrator.provenance.git import ProvenanceError

            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ProvenanceError(
                f"cannot hash the stages' code ({shown}) in {self.repo_root}: {why or 'git gave no id for it'}; "
                "run from a git clone of the project, with git installed"
            )
        return dict(tree_hashes)

    def downstream(self, name: str) -> list[str]:
        """Stages that (transitively) consume ``name``'s output."""
        hit = {name}
        for spec in self.stages:
            if any(up in hit for up in spec.inputs.values()):
                hit.add(spec.name)
        return [s for s in self.order if s in hit and s != name]


#: MoE stages whose programs log to W&B (``workloads/moe/train.py`` and ``repro.py`` open a tracker).
WANDB_STAGES = frozenset({"pretrain", "midtrain", "posttrain", "eval", "repro"})
#: Where the MoE workload's training stages save progress and resume from (``workloads.moe.train.CKPT``,
#: kept equal by a test: the library imports nothing of the workload).
MOE_CHECKPOINT = "checkpoint/state.pt"
MOE_CHECKPOINT_STAGES = frozenset({*TRAINING_STAGES, "repro"})

#: Every MoE stage in pipeline order, and the upstream stage behind each input it reads.
#: ``repro`` (the token-dropping reproduction: one router trained while every dispatch arm is
#: measured) reads only the token shards, so a drop-fraction replica is data -> tokenize -> repro.
MOE_STAGE_INPUTS: dict[str, dict[str, str]] = {
    "data": {},
    "tokenize": {"corpus": "data"},
    "pretrain": {"tokens": "tokenize"},
    "midtrain": {"tokens": "tokenize", "checkpoint": "pretrain"},
    "posttrain": {"tokens": "tokenize", "checkpoint": "midtrain"},
    "eval": {"tokens": "tokenize", "checkpoint": "posttrain"},
    "repro": {"tokens": "tokenize"},
}


def check_stage_selection(stages: Sequence[str], where: str = "stages") -> tuple[str, ...]:
    """``stages`` in pipeline order, after checking each is known, named once, and has its inputs.

    Why here: which stage feeds which is the DAG's knowledge; a recipe that asks for ``repro``
    without ``tokenize`` gets one line naming the missing stage before anything is recorded.
    """
    known = tuple(MOE_STAGE_INPUTS)
    if not stages:
        raise ConfigError(f"{where}: no stages given (known: {', '.join(known)})")
    for name in stages:
        if name not in MOE_STAGE_INPUTS:
            raise ConfigError(f"{where}: unknown stage {name!r}; {choices(name, known)}")
    if len(set(stages)) != len(stages):
        raise ConfigError(f"{where}: a stage is named twice in {list(stages)}")
    for name in stages:
        for key, upstream in MOE_STAGE_INPUTS[name].items():
            if upstream not in stages:
                raise ConfigError(
                    f"{where}: stage {name!r} reads {key!r} from stage {upstream!r}; add {upstream!r} to the stages"
                )
    return tuple(s for s in known if s in stages)


def stages_until(stage: str, stages: Sequence[str], where: str = "--until") -> tuple[str, ...]:
    """``stage`` and every stage it (transitively) reads from, in pipeline order: what runs when a
    user asks to stop at ``stage`` (``--until tokenize``: prepare the data, train later)."""
    if stage not in stages:
        raise ConfigError(f"{where} {stage!r}: not a stage of this run; {choices(stage, stages, label='stages')}")
    needed = {stage}
    for name in reversed(tuple(stages)):
        if name in needed:
            needed.update(MOE_STAGE_INPUTS.get(name, {}).values())
    return tuple(s for s in stages if s in needed)


def _job_resources(asked: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe's resources entry as StageSpec fields: the generic ones, and per-backend options."""
    from orchestrator.recipes import BACKEND_OPTIONS  # not at import: the recipes import the pipeline

    generic = {
        k: v
        for k, v in asked.items()
        if k in ("cpus", "memory", "gpus", "time_limit", "warn_before_limit", "nodes", "tasks_per_node", "backend")
    }
    options = {k: dict(v) for k, v in asked.items() if k in BACKEND_OPTIONS}
    return {**generic, "backend_options": options} if options else generic


def _moe(path: str) -> str:
    return f"workloads/moe/{path}"


def moe_pipeline(
    repo_root: Path | None = None,
    *,
    image: str | None = None,
    stages: Sequence[str] | None = None,
    resources: Mapping[str, Mapping[str, Any]] | None = None,
) -> Pipeline:
    """The MoE replica pipeline: data -> tokenize -> pretrain -> midtrain -> posttrain -> eval by
    default, or the ``stages`` a recipe's replica names (e.g. data -> tokenize -> repro), each
    stage's job asking for the ``resources`` the recipe gives it (cpus, memory, gpus, time_limit).

    Code paths are the workload modules each stage executes; the W&B helper
    (``tracking.py``) is deliberately left out: logging does not change results.
    """
    selected = check_stage_selection(DEFAULT_STAGES if stages is None else stages)
    root = (repo_root or REPO_ROOT).resolve()
    common = [_moe("__init__.py"), _moe("__main__.py"), _moe("config.py"), _moe("util.py")]
    # training and eval read token shards through tokenizing.py, which imports data.py; train.py averages
    # gradients and weights the loss over a job's tasks in distributed.py and steps AdamW in optim.py
    # (each module a stage imports, however indirectly, decides its result: one left out, an edit to it
    # reused the stale result)
    model = [
        _moe("model.py"),
        _moe("dispatch.py"),
        _moe("metrics.py"),
        _moe("data.py"),
        _moe("tokenizing.py"),
        _moe("distributed.py"),
        _moe("optim.py"),
        _moe("train.py"),
    ]
    declared: dict[str, Sequence[str]] = {
        "data": [*common, _moe("data.py")],
        "tokenize": [*common, _moe("data.py"), _moe("tokenizing.py")],
        "pretrain": [*common, *model],
        "midtrain": [*common, *model],
        "posttrain": [*common, *model],
        "eval": [*common, *model],
        "repro": [*common, *model, _moe("repro.py")],
    }
    torch_env = ("python_version", "pkg:torch", "pkg:numpy")
    env: dict[str, tuple[str, ...]] = {
        # the default corpus is the Python standard library's own source
        "data": ("python_version",),
        "tokenize": ("pkg:tokenizers", "pkg:numpy"),
        "pretrain": torch_env,
        "midtrain": torch_env,
        "posttrain": torch_env,
        "eval": torch_env,
        "repro": torch_env,
    }
    specs = []
    for name in selected:
        paths = tuple(p for p in declared[name] if (root / p).exists())
        specs.append(
            StageSpec(
                name=name,
                inputs=MOE_STAGE_INPUTS[name],
                code_paths=paths,
                environment_fields=env[name],
                snapshot_output=name == "data",
                tracks_wandb=name in WANDB_STAGES,
                checkpoint=MOE_CHECKPOINT if name in MOE_CHECKPOINT_STAGES else None,
                **_job_resources((resources or {}).get(name) or {}),
            )
        )
    return Pipeline(name="moe-replica", stages=tuple(specs), repo_root=root, image=image)


def default_python(backend: str, settings: Settings | None = None, *, in_image: bool = False) -> str:
    """The interpreter a stage command starts with.

    ``[backends.<name>] python`` in the config wins (the same option names the interpreter the
    launcher runs its helper scripts with). Otherwise ``python3`` inside the image when the job
    runs in one (``in_image``: the launcher's ``environment_image()`` answered, so the stage
    identity is the image's and the command must use the image's interpreter too; ``python3``,
    the launchers' default, is in every image with a Python 3, plain ``python`` only in some), else
    this interpreter: on the local backend and on Slurm a job inherits the submitter's
    environment, and clusters share the filesystem the project's venv lives on, so the path is
    valid on the node; a bare ``python`` there would be the node's system Python without the
    workload's packages.
    """
    configured = settings.section(f"backends.{backend}").get("python") if settings is not None else None
    if configured:
        return str(configured)
    return DEFAULT_PYTHON if in_image else sys.executable


__all__ = [
    "DEFAULT_STAGES",
    "DEFAULT_VOLATILE",
    "MOE_STAGE_INPUTS",
    "REPO_ROOT",
    "WANDB_STAGES",
    "Pipeline",
    "StageSpec",
    "check_stage_selection",
    "default_python",
    "moe_pipeline",
    "stages_until",
]
