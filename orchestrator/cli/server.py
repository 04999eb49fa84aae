"""``openlab server``: a local Prefect server plus a runner serving openlab's deployments.

One command gives a person the whole product on a laptop: the Prefect UI with the
replica pipeline and the nightly ready to run. The server is a real ``prefect server
start`` subprocess (SQLite under ``$OPENLAB_HOME/prefect`` unless ``[prefect]
database_url`` names PostgreSQL); this process registers both deployments and serves
them, so UI-triggered and scheduled runs execute here as subprocesses.

Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed, the ssh connection lost) stops the runner
first — its in-flight runs are cancelled, which cancels their backend jobs — and then the server.
Killed outright (SIGKILL, the OOM killer), it cannot: Linux then sends the server SIGTERM, and a
server that outlived its ``openlab server`` anyway is stopped by the next one for the same
``$OPENLAB_HOME``, which says so, and starts afresh with its own settings rather than adopt a server
nobody stops. Stopping pauses nothing (Prefect's
``serve()`` would pause every served deployment), and registering at start keeps what is
paused on the server, as set in the UI, and says so; ``--resume`` turns it all back on.
``--api-url`` attaches to a server that is already running (a team's PostgreSQL-backed
one) and serves only.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import typer

from orchestrator.cli.output import console, err_console, print_error, say
from orchestrator.prefect_server import PrefectServer, health_ok, use_api
from orchestrator.secrets import scrub
from orchestrator.settings import load_settings


def _sigterm_to_interrupt(_signum: int, _frame: FrameType | None) -> None:
    """Treat SIGTERM like Ctrl-C so ``kill`` also stops the runner and the server in order."""
    raise KeyboardInterrupt


def _sighup_as_sigterm(_signum: int, _frame: FrameType | None) -> None:
    """A hangup (terminal closed, ssh lost) stops as SIGTERM does, through whichever SIGTERM handler is
    in place: ours before serving, the Prefect runner's while serving (it cancels the in-flight runs).
    By default SIGHUP killed this process alone and left the server and the flow runs behind."""
    os.kill(os.getpid(), signal.SIGTERM)


def server(
    host: str = typer.Option(None, help="Address the server listens on ([prefect] host, default 127.0.0.1)."),
    port: int = typer.Option(None, help="Server port ([prefect] port, default 4200)."),
    api_url: str = typer.Option(
        None, "--api-url", help="Use this running Prefect API instead of starting a server (serve only)."
    ),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Serve the deployments (else: server only)."),
    nightly_cron: str = typer.Option(None, "--nightly-cron", help="Cron for the nightly ([prefect] nightly_cron)."),
    limit: int = typer.Option(None, help="Most flow runs executed at once by this runner."),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Resume every deployment and schedule paused on the server (else they stay paused, as set in the UI).",
    ),
) -> None:
    """Start Prefect (or attach with --api-url), print the UI address and serve until Ctrl-C."""
    from orchestrator.errors import OpenlabError
    from orchestrator.lineage.store import display_url

    settings = load_settings()
    if limit is not None and limit < 1:
        raise OpenlabError(f"--limit {limit}: give the most flow runs at once, 1 or more (leave it out: no limit)")
    if serve:  # refused before a server starts, not after it has (its schedules would be built with it)
        from flows.deployments import (
            DEFAULT_DROPS_NIGHTLY_CRON,
            digest_cron,
            gc_cron,
            nightly_timezone,
            reconcile_every,
        )
        from flows.deployments import nightly_cron as checked_cron

        checked_cron(settings, nightly_cron)
        # every schedule the deployments are built with: a bad gc_cron or reconcile_every_s failed only once
        # the Prefect server had started and said where its UI was
        checked_cron(settings, key="nightly_drops_cron", default=DEFAULT_DROPS_NIGHTLY_CRON)
        gc_cron(settings)
        digest_cron(settings)
        reconcile_every(settings)
        nightly_timezone(settings)
    previous = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    # `nohup openlab server` asked to outlive the terminal: its ignored SIGHUP stays ignored
    previous_hup = signal.getsignal(signal.SIGHUP)
    if previous_hup is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _sighup_as_sigterm)
    started: PrefectServer | None = None
    up = False  # "stopped" is said of something that ran, not after a refusal
    try:
        if api_url:
            if not health_ok(api_url):
                shown = scrub(api_url, ())  # a password in the URL (a proxy's basic auth) is not printed
                raise OpenlabError(f"no Prefect API answers at {shown}: check the URL or drop --api-url")
            ui = api_url.rstrip("/").removesuffix("/api")
        else:
            started = PrefectServer.from_settings(settings, host=host, port=port, stop_with_parent=True)
            left = started.stop_leftover()
            if left is not None:
                err_console.print(
                    f"stopped the Prefect server (pid {left.pid}, port {left.port}) that an earlier `openlab server` "
                    f"for {settings.home} left running when it was killed; starting a new one",
                    highlight=False,
                    soft_wrap=True,  # one line, whatever the width: it is read, and grepped, whole
                )
            started.check_port()  # before "starting": a port in use is refused, not a server started and stopped
            err_console.print(f"starting Prefect server (database {display_url(started.database_url or '')}) ...")
            started.start()
            api_url, ui = started.api_url, started.ui_url
            err_console.print(f"server log: {started.log_path}")
        up = True
        console.print(f"Prefect UI: {scrub(ui, ())}", highlight=False)  # a URL's password masked
        shown = scrub(api_url, ())
        console.print(f"Prefect API: {shown}  (export PREFECT_API_URL={shown} to use it)", highlight=False)
        if not serve:
            console.print("serving nothing (--no-serve); press Ctrl-C to stop", highlight=False)
            signal.pause()
            return
        from flows.deployments import KeptState, build_deployments, in_repo_root, serve_deployments
        from orchestrator.settings import pin_environment

        pin_environment(settings)  # the flow runs start in the repository's root: they read these as given here
        with use_api(api_url), in_repo_root():
            deployments = build_deployments(settings, cron=nightly_cron)
            for d in deployments:
                console.print(f"serving deployment {d.full_name}: {scrub(ui, ())}/deployments", highlight=False)

            def report(kept: KeptState) -> None:  # before serving starts: what stays paused, and how to resume it
                for line in kept.lines("openlab server"):
                    say(line)
                console.print("press Ctrl-C to stop", highlight=False)
                sys.stdout.flush()

            serve_deployments(deployments, limit=limit, resume=resume, report=report)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_hup is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, previous_hup)
        launched = started is not None and started.process is not None  # a refused start (port in use) ran nothing
        if started is not None:
            if launched:
                err_console.print("stopping Prefect server ...")
            started.stop()
        if up or launched:
            err_console.print("stopped")


if __name__ == "__main__":  # `python -m orchestrator.cli.server`: usable before it is mounted
    from orchestrator.errors import OpenlabError

    try:
        alone = typer.Typer(add_completion=False, pretty_exceptions_enable=False)  # one command: runs as it
        alone.command()(server)
        alone(prog_name="openlab server")
    except OpenlabError as exc:
        print_error(exc)
        sys.exit(exc.exit_code)
