"""Typed settings: where openlab keeps its state and how each part is configured.

Resolution order, lowest to highest precedence (the same for every key):

1. built-in defaults;
2. the project file: ``$OPENLAB_CONFIG``, else the nearest ``openlab.toml`` from the
   working directory upwards, else ``[tool.openlab]`` in the nearest ``pyproject.toml``;
3. environment variables: ``OPENLAB_HOME``, ``OPENLAB_DB_URL`` and, for any nested key,
   ``OPENLAB_<SECTION>__<KEY>`` (double underscore between levels), e.g.
   ``OPENLAB_BACKENDS__SLURM__PARTITION=debug``;
4. command-line flags, which callers apply on top with :meth:`Settings.section`'s result.

A relative path (:data:`PATH_SETTINGS`, a SQLite ``db_url``) is made absolute where it is read:
under the config file's folder for the file, under the working directory for a variable.

Secrets are never stored here: a section names the *variable* that holds a token
(``token_env = "GITHUB_TOKEN"``), and the value is read where it is used.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, choices

ENV_PREFIX = "OPENLAB_"

#: Every setting openlab reads, by section (``None``: a value, not a table). A key outside it would be
#: read by nothing: ``[lineage] db_url`` would leave lineage in SQLite while its author believes it is in
#: PostgreSQL. ``[backends]`` is the launchers' to check (each backend takes its own options).
KNOWN_SETTINGS: dict[str, frozenset[str] | None] = {
    "home": None,
    "db_url": None,
    "artifacts": frozenset({"root"}),
    "backends": None,
    "pipeline": frozenset({"stage_retries", "preemption_retries"}),
    "prefect": frozenset(
        {
            "api_url",
            "database_url",
            "home",
            "host",
            "port",
            "nightly_cron",
            "nightly_drops_cron",
            "nightly_timezone",
            "digest_cron",
            "gc_cron",
            "reconcile_every_s",
        }
    ),
    "github": frozenset(
        {
            "repo",
            "token_env",
            "base_url",
            "strict",
            "required",
            "max_wait_s",
            "timeout_s",
            "per_page",
            "seconds_between_requests",
            "seconds_between_writes",
            "labels",
            "commit_statuses",
            "regression_issues",
            "regression_label",
        }
    ),
    "wandb": frozenset({"project", "entity"}),
}


def _find_upwards(start: Path, name: str) -> Path | None:
    for folder in (start, *start.parents):
        candidate = folder / name
        if candidate.is_file():
            return candidate
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # UTF-16 from an editor, or not a text file at all
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start : exc.start + 1]!r}): "
            "save it as UTF-8 text, as TOML must be"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None


def _coerce(text: str) -> Any:
    """Read an environment value as TOML when it parses as a scalar, else as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_project_config(
    cwd: Path | None = None, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], Path | None]:
    """Return the project's openlab configuration and the file it came from (if any): the one
    ``OPENLAB_CONFIG`` names in ``environ`` (default this process's), else the nearest above ``cwd``."""
    explicit = (os.environ if environ is None else environ).get("OPENLAB_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        if path == Path(os.devnull):  # as GIT_CONFIG_GLOBAL=/dev/null is: no settings at all
            return {}, path
        if not path.is_file():  # a pipe or a device other than that would be read for ever
            if path.is_dir():
                what = "is a folder, not a file"
            else:
                what = "is not a regular file" if path.exists() else "does not exist"
            raise ConfigError(f"OPENLAB_CONFIG names {path}, which {what}")
        data = _read_toml(path)
        if path.name != "pyproject.toml":
            return data, path
        section = data.get("tool", {}).get("openlab")
        if not isinstance(section, dict):  # the whole file was read as openlab's: "[project] is not a setting"
            raise ConfigError(
                f"OPENLAB_CONFIG names {path}, which has no [tool.openlab] table: "
                "add one there, or name an openlab.toml"
            )
        return section, path
    start = (cwd or Path.cwd()).resolve()
    toml_path = _find_upwards(start, "openlab.toml")
    if toml_path:
        return _read_toml(toml_path), toml_path
    pyproject = _find_upwards(start, "pyproject.toml")
    if pyproject:
        data = _read_toml(pyproject).get("tool", {}).get("openlab")
        if isinstance(data, dict):
            return data, pyproject
    return {}, None


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:  # OPENLAB___: an IndexError traceback
            raise ConfigError(f"{name} names no setting: write OPENLAB_SECTION__KEY, as OPENLAB_PREFECT__PORT")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:  # a path is text as written: OPENLAB_ARTIFACTS__ROOT=2026 is a folder, not a number
            node[parts[-1]] = value if tuple(parts) in PATH_SETTINGS else _coerce(value)
    return out


@dataclass(frozen=True)
class Settings:
    """Resolved settings for one process."""

    home: Path
    db_url: str
    config: dict[str, Any] = field(default_factory=dict)
    config_path: Path | None = None

    @property
    def snapshots_dir(self) -> Path:
        return self.home / "snapshots"

    @property
    def blobs_dir(self) -> Path:
        """Content-addressed store for small artifacts such as dirty-tree patches."""
        return self.home / "blobs"

    @property
    def artifacts_dir(self) -> Path:
        """Default artifact root that jobs write their outputs under."""
        configured = self.config.get("artifacts", {}).get("root")
        return Path(configured).expanduser() if configured else self.home / "artifacts"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @cached_property
    def is_sqlite(self) -> bool:
        return self.db_url.startswith("sqlite")

    @property
    def default_backend(self) -> str:
        """Where jobs run when no ``--backend`` is given: ``[backends] default``, else local."""
        return str(self.section("backends").get("default") or "local")

    def section(self, dotted: str) -> dict[str, Any]:
        """Return a config section (``"backends.slurm"``) as a dict, empty when absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict):
                return {}
            node = node.get(part, {})
        return dict(node) if isinstance(node, dict) else {}


def check_known(config: Mapping[str, Any], path: Path | None, environ: Mapping[str, str]) -> None:
    """Raise :class:`ConfigError` for a section or key openlab reads nowhere (:data:`KNOWN_SETTINGS`),
    naming where it was written (the variable, else the file) and the name meant: a misspelt setting
    would otherwise be ignored and its author never told."""

    def where(*parts: str) -> str:
        name = ENV_PREFIX + "__".join(p.upper() for p in parts)
        variables = sorted(n for n in environ if n.upper() == name or n.upper().startswith(name + "__"))
        return f"{variables[0]}: " if variables else f"{path}: " if path else ""

    for key, value in config.items():
        if key not in KNOWN_SETTINGS:
            raise ConfigError(
                f"{where(key)}[{key}] is not an openlab setting: {choices(key, KNOWN_SETTINGS, label='settings')}"
            )
        keys = KNOWN_SETTINGS[key]
        if keys is None and key != "backends":  # a value (home, db_url)
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where(key)}{key} = {value!r}: {key} is a table of settings, [{key}], not a value")
        if keys is None:  # [backends]: a table per backend, a misspelt one named here, its options by its launcher
            from orchestrator.launchers.base import check_backends_section

            check_backends_section(value, where)
            continue
        for name in value:
            if name not in keys:
                hint = choices(name, sorted(keys), label=f"[{key}] has")
                raise ConfigError(f"{where(key, name)}[{key}] {name}: no such setting; {hint}")
    for keys in (*PATH_SETTINGS, ("db_url",)):  # Path(5) was a TypeError traceback
        value: Any = config
        for key in keys:
            value = value.get(key) if isinstance(value, Mapping) else None
        if value is not None and not (isinstance(value, str) and value.strip()):
            name = keys[0] if len(keys) == 1 else f"[{'.'.join(keys[:-1])}] {keys[-1]}"
            what = "a database URL" if keys == ("db_url",) else "a path"
            if len(keys) > 1:
                source = where(*keys)
            else:  # OPENLAB_HOME itself is read apart, never here: OPENLAB_HOME__X=1 made it a table
                nested = sorted(n for n in environ if n.upper().startswith(f"{ENV_PREFIX}{keys[0].upper()}__"))
                source = f"{nested[0]}: " if nested else f"{path}: " if path else ""
            raise ConfigError(f"{source}{name} = {value!r}: give {what} as text, in quotes")


#: Settings that name a place on disk, as key paths. A relative one is read from where it was
#: written (the config file's folder; the working directory for a variable) and kept absolute:
#: jobs run in the repository root, served flows in the server's folder and later commands from
#: anywhere, so ``OPENLAB_HOME=.openlab`` kept relative sent every job's ``--out`` elsewhere and
#: the next command from another folder to an empty store (Marin's relative prefix, #6334).
PATH_SETTINGS: tuple[tuple[str, ...], ...] = (
    ("home",),
    ("artifacts", "root"),
    ("prefect", "home"),
    ("backends", "slurm", "log_dir"),  # sbatch writes there from the job's folder, openlab reads from its own
    ("backends", "slurm", "slurm_conf"),
    ("backends", "slurm", "bin_dir"),
    ("backends", "kubernetes", "kubeconfig"),
    ("backends", "kubernetes", "template"),
)

_SQLITE_URL = re.compile(r"^(sqlite(?:\+\w+)?:///)(?!/|:memory:|$)(.+)$")


def absolute_path(value: Any, base: Path) -> Any:
    """``value`` as an absolute path (``~`` expanded, a relative one under ``base``); anything but
    text is left for :func:`check_known` and its reader to refuse."""
    if not isinstance(value, str) or not value:
        return value
    path = expand_user(value)
    return str(path if path.is_absolute() else base / path)


def yes_or_no(value: Any) -> bool | None:
    """A yes/no setting's value: a boolean, or its text (``true``, ``off``, ``1``...; settings come
    from variables and forms as text, where ``"false"``, a non-empty string, would be true); None
    for anything else, which its reader refuses naming the setting."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in ("true", "1", "yes", "on") else False if text in ("false", "0", "no", "off") else None


def expand_user(value: str | Path) -> Path:
    """``Path(value).expanduser()``, where ``~nosuchuser`` (a RuntimeError traceback out of every
    command) is a :class:`ConfigError` naming it."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        user = str(value).split("/")[0]
        raise ConfigError(f"{value}: no such user here to expand {user} for; write the path out") from None


def absolute_db_url(value: Any, base: Path) -> Any:
    """A SQLite URL with a relative file (``sqlite:///lineage.db``) made absolute under ``base``;
    other URLs (PostgreSQL, ``sqlite://`` in memory) as they are."""
    if not isinstance(value, str):
        return value
    match = _SQLITE_URL.match(value)
    return f"{match.group(1)}{absolute_path(match.group(2), base)}" if match else value


def anchor_paths(config: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """``config`` with each :data:`PATH_SETTINGS` value and ``db_url`` made absolute under ``base``."""
    out = copy.deepcopy(dict(config))
    for keys in PATH_SETTINGS:
        node: Any = out
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node:
            node[keys[-1]] = absolute_path(node[keys[-1]], base)
    if "db_url" in out:
        out["db_url"] = absolute_db_url(out["db_url"], base)
    return out


def pin_environment(settings: Settings, environ: MutableMapping[str, str] | None = None) -> None:
    """Put ``settings``' home, project file and database URL in ``environ`` (default this process's),
    absolute: what a child process started elsewhere then reads. ``openlab server`` serves from the
    repository's root, and the flow runs it starts read ``OPENLAB_HOME=.openlab`` (given where the
    server was started) against that root, or found another ``openlab.toml``: another home, another
    backend, from the server's own."""
    env = os.environ if environ is None else environ
    env["OPENLAB_HOME"] = str(settings.home)
    if settings.config_path is not None:
        env["OPENLAB_CONFIG"] = str(settings.config_path.absolute())
    if env.get("OPENLAB_DB_URL"):
        env["OPENLAB_DB_URL"] = settings.db_url


def load_settings(cwd: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve settings from defaults, the project file and the environment; refuse a setting
    nothing reads (:func:`check_known`). Paths come back absolute (:data:`PATH_SETTINGS`)."""
    env = os.environ if environ is None else environ
    here = (cwd or Path.cwd()).absolute()
    file_config, path = load_project_config(cwd, env)
    if path is not None:
        file_config = anchor_paths(file_config, path.absolute().parent)
    config = _merge(file_config, anchor_paths(_env_overrides(env), here))
    check_known(config, path, env)
    home = Path(absolute_path(env.get("OPENLAB_HOME") or config.get("home") or "~/.openlab", here))
    db_url = (
        absolute_db_url(env.get("OPENLAB_DB_URL"), here) or config.get("db_url") or f"sqlite:///{home / 'lineage.db'}"
    )
    return Settings(home=home, db_url=str(db_url), config=config, config_path=path)
