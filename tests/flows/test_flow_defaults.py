"""What the flows' run forms leave empty: the backend is openlab.toml's, as `openlab run` has it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.pipeline import flow_backend
from orchestrator.errors import ConfigError
from orchestrator.settings import load_settings


def test_a_flow_left_without_a_backend_runs_on_the_configured_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, openlab_home: Path
) -> None:
    """The scheduled nightly's form is filled in by nobody: its backend was "local" whatever
    `[backends] default` said, so a lab's nightly ran on the Prefect server's own machine."""
    config = tmp_path / "openlab.toml"
    monkeypatch.setenv("OPENLAB_CONFIG", str(config))
    config.write_text('[backends]\ndefault = "slurm"\n')
    assert flow_backend(None, load_settings()) == "slurm"
    assert flow_backend("docker", load_settings()) == "docker", "the form's own choice wins"
    config.write_text("")
    assert flow_backend(None, load_settings()) == "local"
    config.write_text('[backends]\ndefault = "slurmm"\n')
    with pytest.raises(ConfigError, match=r"\[backends\] default = 'slurmm' is not a backend: did you mean 'slurm'\?"):
        flow_backend(None, load_settings())
