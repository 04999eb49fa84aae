"""The nightly comparison as a library: planted regressions are flagged, unchanged runs pass."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import Commit, LineageStore, PipelineRun, StageRun
from orchestrator.nightly import (
    NightlyRegression,
    Tolerance,
    Verdict,
    check_metric,
    evaluate_nightly,
    parse_tolerances,
    raise_for_verdict,
)

TOLERANCES = [
    Tolerance("eval/loss", rel=0.02, worse="higher", stage="eval"),
    Tolerance("moe/drop_fraction", abs=0.01),
]


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[LineageStore]:
    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as s:
        yield s


def plant_run(
    store: LineageStore, sha: str, loss: float, drop: float, *, minutes: int, state: str = "COMPLETED"
) -> PipelineRun:
    """A finished nightly-shaped pipeline run with an eval and a pretrain stage and a commit."""
    stages = {"pretrain": {"moe": {"drop_fraction": drop}}, "eval": {"eval/loss": loss}}
    return _plant(store, sha, "tiny", stages, minutes=minutes, state=state)


def _plant(
    store: LineageStore, sha: str, replica: str, stages: dict[str, dict], *, minutes: int, state: str = "COMPLETED"
) -> PipelineRun:
    """A pipeline run at commit ``sha`` whose stages (in order, a second apart) recorded ``stages``' metrics."""
    start = dt.datetime(2026, 1, 1, 2, tzinfo=dt.UTC) + dt.timedelta(minutes=minutes)
    with store.transaction() as tx:
        run = tx.add(PipelineRun(recipe="marin-535b-a23b", replica=replica, state=state, started_at=start))
        tx.relate("wasAssociatedWith", run, tx.ensure(Commit(id=sha, sha=sha)), role="code")
        for i, (stage, metrics) in enumerate(stages.items()):
            tx.add(
                StageRun(
                    pipeline_run_id=run.id,
                    stage=stage,
                    identity=f"{stage[0]}-{sha}",
                    state="COMPLETED",
                    metrics=metrics,
                    started_at=start + dt.timedelta(seconds=i),
                )
            )
    return run


def test_first_nightly_is_the_baseline_and_is_recorded(store: LineageStore) -> None:
    run = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    verdict = evaluate_nightly(store, run.id, TOLERANCES)
    assert verdict.status == "baseline" and verdict.passed
    stored = store.require(PipelineRun, run.id)
    assert stored.verdict is not None and stored.verdict["status"] == "baseline"
    assert [e.action for e in store.events(run.id)][-1] == "update"  # written through a logged transaction


def test_a_run_of_another_branch_or_backend_is_not_the_next_nightlys_baseline(store: LineageStore) -> None:
    """Run nightly-replica from the UI on a branch (or on slurm), and the next scheduled nightly of
    main (on local) was judged against that branch's figures."""
    good = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    assert evaluate_nightly(store, good.id, TOLERANCES).status == "baseline"
    branch = plant_run(store, "b" * 40, 9.0, 0.10, minutes=10)
    slurm = plant_run(store, "c" * 40, 9.0, 0.10, minutes=20)
    with store.transaction() as tx:
        tx.update(branch, params={"prefect": {"git_ref": "my-branch"}})
        tx.update(slurm, backend="slurm")
    assert evaluate_nightly(store, branch.id, TOLERANCES).status == "baseline", "judged against its own ref's"
    assert evaluate_nightly(store, slurm.id, TOLERANCES).status == "baseline", "judged against its own backend's"
    nightly = plant_run(store, "d" * 40, 3.0, 0.10, minutes=30)
    verdict = evaluate_nightly(store, nightly.id, TOLERANCES)
    assert verdict.status == "passed" and verdict.previous_run_id == good.id, verdict


def test_unchanged_run_passes(store: LineageStore) -> None:
    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    again = plant_run(store, "b" * 40, 3.0 * 1.01, 0.105, minutes=1440)
    verdict = raise_for_verdict(evaluate_nightly(store, again.id, TOLERANCES))
    assert verdict.status == "passed"
    assert verdict.previous_run_id == base.id and verdict.previous_commit == "a" * 40
    assert store.require(PipelineRun, again.id).verdict["status"] == "passed"


def test_planted_regression_names_metric_values_and_commits(store: LineageStore) -> None:
    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    bad = plant_run(store, "c" * 40, 3.3, 0.10, minutes=1440)
    verdict = evaluate_nightly(store, bad.id, TOLERANCES)
    with pytest.raises(NightlyRegression) as info:
        raise_for_verdict(verdict)
    text = str(info.value)
    assert "eval/loss" in text and "3 at" in text and "3.3 at" in text
    assert "a" * 12 in text and "c" * 12 in text
    assert "moe/drop_fraction" not in text
    recorded = Verdict.from_dict(store.require(PipelineRun, bad.id).verdict)
    assert recorded.status == "regressed" and [c.metric for c in recorded.regressions] == ["eval/loss"]

    # A regressed nightly never becomes the baseline: the next one compares with `base`.
    later = plant_run(store, "d" * 40, 3.0, 0.10, minutes=2880)
    assert evaluate_nightly(store, later.id, TOLERANCES).previous_run_id == base.id


def test_drop_fraction_change_in_either_direction_is_flagged(store: LineageStore) -> None:
    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    run = plant_run(store, "e" * 40, 3.0, 0.05, minutes=60)
    verdict = evaluate_nightly(store, run.id, TOLERANCES)
    assert [c.metric for c in verdict.regressions] == ["moe/drop_fraction"]


def test_failed_pipeline_runs_are_not_baselines(store: LineageStore) -> None:
    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    crashed = plant_run(store, "f" * 40, 9.0, 0.9, minutes=30, state="FAILED")
    evaluate_nightly(store, crashed.id, TOLERANCES)
    run = plant_run(store, "b" * 40, 3.0, 0.10, minutes=60)
    assert evaluate_nightly(store, run.id, TOLERANCES).previous_run_id == base.id


def test_reused_stages_carry_the_metrics_of_the_run_they_reuse(store: LineageStore) -> None:
    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    originals = store.list(StageRun, pipeline_run_id=base.id)
    with store.transaction() as tx:
        run = tx.add(
            PipelineRun(
                recipe="marin-535b-a23b",
                replica="tiny",
                state="COMPLETED",
                started_at=base.started_at + dt.timedelta(days=1),
            )
        )
        for s in originals:
            tx.add(
                StageRun(pipeline_run_id=run.id, stage=s.stage, identity=s.identity, state="REUSED", reused_from=s.id)
            )
    assert evaluate_nightly(store, run.id, TOLERANCES).status == "passed"


def test_baseline_without_a_tracked_metric_fails_and_says_what_is_reported(store: LineageStore) -> None:
    run = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    verdict = evaluate_nightly(store, run.id, [*TOLERANCES, Tolerance("eval/accuracy", abs=0.01, stage="eval")])
    assert verdict.status == "regressed" and not verdict.passed
    assert "eval/accuracy" in verdict.message and "eval/loss" in verdict.message  # what *is* reported


def test_vanished_metric_is_a_regression() -> None:
    assert check_metric(Tolerance("eval/loss", rel=0.1), 3.0, None).regressed
    assert check_metric(Tolerance("eval/loss", rel=0.1), None, None).regressed  # never measured: never passes
    assert check_metric(Tolerance("eval/loss", rel=0.1), 3.0, float("nan")).regressed
    assert not check_metric(Tolerance("eval/loss", rel=0.1), None, 3.0).regressed
    assert not check_metric(Tolerance("acc", abs=0.01, worse="lower"), 0.5, 0.9).regressed
    assert check_metric(Tolerance("acc", abs=0.01, worse="lower"), 0.5, 0.4).regressed


def test_parse_tolerances_shapes_and_errors() -> None:
    parsed = parse_tolerances({"eval/loss": 0.02, "moe/drop_fraction": {"abs": 0.01, "worse": "higher"}})
    assert parsed == [Tolerance("eval/loss", rel=0.02), Tolerance("moe/drop_fraction", abs=0.01, worse="higher")]
    assert parse_tolerances([{"metric": "x", "rel": 0.1}]) == [Tolerance("x", rel=0.1)]
    # The recipes' own spelling (recipes/marin-535b-a23b.yaml, tracked_metrics).
    assert parse_tolerances({"eval/loss": {"stage": "eval", "relative": 0.02}}) == [
        Tolerance("eval/loss", rel=0.02, stage="eval")
    ]
    # What orchestrator.recipes resolves from the real recipe file.
    from orchestrator.recipes import resolve

    recipe = resolve("marin-535b-a23b", "tiny", validate=False)
    tracked = parse_tolerances(recipe.tracked_metrics)
    assert [t.metric for t in tracked] == [m.name for m in recipe.tracked_metrics] and tracked
    for tol, metric in zip(tracked, recipe.tracked_metrics, strict=True):
        want = (metric.stage, metric.relative, metric.absolute, metric.stderr)
        assert (tol.stage, tol.rel, tol.abs, tol.stderr) == want
    assert Tolerance("x", rel=0.1, abs=0.01).allowance(1.0) == 0.01  # both must hold
    with pytest.raises(ConfigError, match=r"tracked_metrics.x.tol: unknown key; known: rel, abs"):
        parse_tolerances({"x": {"tol": 1}})
    with pytest.raises(ConfigError, match="tracked_metrics.x.rel"):
        parse_tolerances({"x": {"rel": "lots"}})
    with pytest.raises(ConfigError, match="worse"):
        parse_tolerances({"x": {"rel": 0.1, "worse": "sideways"}})


NOISY = Tolerance(
    "repro/pooled_wave_1.15_1.15/late_median_drop",
    abs=0.005,
    stage="repro",
    stderr="repro/pooled_wave_1.15_1.15/late_median_drop_se",
    sigmas=3,
)


def plant_repro_run(store: LineageStore, sha: str, median: float, se: float | None, *, minutes: int) -> PipelineRun:
    """A finished drops-replica nightly: the repro stage's headline as the workload reports it."""
    headline: dict[str, float] = {"late_median_drop": median}
    if se is not None:
        headline["late_median_drop_se"] = se
    return _plant(store, sha, "drops", {"repro": {"repro": {"pooled_wave_1.15_1.15": headline}}}, minutes=minutes)


def test_noisy_metric_is_judged_against_its_own_standard_error(store: LineageStore) -> None:
    """Two 4-layer runs of the same seed whose training differed only in float rounding gave 4.82% and
    5.35% on pooled-wave 1.15/1.15, each median with a standard error of about 0.7 points: a re-draw,
    which a fixed ±0.5-point tolerance would fail. A move of several standard errors still fails, and
    the message says what the allowance was made of."""
    base = plant_repro_run(store, "a" * 40, 0.0482, 0.0072, minutes=0)
    assert evaluate_nightly(store, base.id, [NOISY]).status == "baseline"
    redraw = plant_repro_run(store, "b" * 40, 0.0535, 0.0075, minutes=1440)
    verdict = evaluate_nightly(store, redraw.id, [NOISY])
    assert verdict.status == "passed", verdict.message
    (check,) = verdict.checks
    assert math.isclose(check.noise, math.hypot(0.0072, 0.0075))
    assert math.isclose(check.allowed, 3 * math.hypot(0.0072, 0.0075))
    # The same change against the fixed tolerance alone is a failure: the reason the stderr exists.
    assert check_metric(Tolerance(NOISY.metric, abs=0.005), 0.0482, 0.0535).regressed

    broken = plant_repro_run(store, "c" * 40, 0.0982, 0.0080, minutes=2880)
    verdict = evaluate_nightly(store, broken.id, [NOISY])
    assert verdict.status == "regressed"
    assert "standard error of the difference" in verdict.message and "b" * 12 in verdict.message


def test_noisy_metric_without_its_standard_error_falls_back_to_the_fixed_tolerance() -> None:
    """A run that does not report the standard error (an older workload) gets the stricter fixed
    tolerance, never a looser one, and the note says why."""
    check = check_metric(NOISY, 0.0482, 0.0535, 0.0072, None)
    assert check.regressed and check.noise is None
    assert "late_median_drop_se not reported by both runs" in check.note
    assert not check_metric(NOISY, 0.0482, 0.0512, 0.0072, None).regressed  # within the 0.5-point floor
    # A tiny standard error never narrows the allowance below the fixed floor.
    assert check_metric(NOISY, 0.0482, 0.0512, 0.0001, 0.0001).allowed == 0.005


def test_parse_noise_scaled_tolerances() -> None:
    parsed = parse_tolerances({"m": {"abs": 0.005, "stderr": "m_se", "sigmas": 2.5, "stage": "repro"}})
    assert parsed == [Tolerance("m", abs=0.005, stage="repro", stderr="m_se", sigmas=2.5)]
    assert parse_tolerances({"m": {"abs": 0.005, "stderr": "m_se"}})[0].sigmas == 3.0
    with pytest.raises(ConfigError, match=r"tracked_metrics.m.sigmas: needs stderr"):
        parse_tolerances({"m": {"abs": 0.005, "sigmas": 3}})
    with pytest.raises(ConfigError, match=r"tracked_metrics.m.sigmas"):
        parse_tolerances({"m": {"abs": 0.005, "stderr": "m_se", "sigmas": -1}})
    # The drops replica's tracked arms, as the recipe resolves them, are all noise-scaled.
    from orchestrator.recipes import resolve

    tracked = parse_tolerances(resolve("marin-535b-a23b", "drops", validate=False).tracked_metrics)
    assert tracked and all(t.stderr == f"{t.metric}_se" and t.sigmas == 3 for t in tracked)


def test_a_metric_tracked_for_one_stage_is_that_stages_only(store: LineageStore) -> None:
    """Pretrain, mid-train and post-train report `eval/code/loss` too. An eval that did not report
    it had the bare name looked up instead, the first stage's value: "passed", comparing yesterday's
    eval with today's pretrain estimate. It is "not reported by this run", which never passes."""
    tracked = [Tolerance("eval/code/loss", rel=0.02, stage="eval")]
    both = {"pretrain": {"eval": {"code": {"loss": 3.0}}}, "eval": {"eval": {"code": {"loss": 3.1}}}}
    base = _plant(store, "a" * 40, "tiny", both, minutes=0)
    assert evaluate_nightly(store, base.id, tracked).status == "baseline"
    no_eval = {"pretrain": {"eval": {"code": {"loss": 3.0}}}, "eval": {"eval": {"tokens_seen": 100}}}
    run = _plant(store, "b" * 40, "tiny", no_eval, minutes=1440)
    verdict = evaluate_nightly(store, run.id, tracked)
    assert verdict.status == "regressed", verdict.message
    assert (verdict.checks[0].previous, verdict.checks[0].current, verdict.checks[0].note) == (
        3.1,
        None,
        "no longer reported",
    )


def test_a_nan_or_infinite_baseline_is_never_what_a_later_nightly_passes_against(store: LineageStore) -> None:
    """A first nightly whose loss was NaN became the baseline, and the next one, at loss 50, passed
    against it (the allowance was NaN); an infinite previous value allowed any change."""
    nan = plant_run(store, "a" * 40, float("nan"), 0.10, minutes=0)
    verdict = evaluate_nightly(store, nan.id, TOLERANCES)
    assert verdict.status == "regressed" and verdict.checks[0].note == "not a finite number", verdict.message
    good = plant_run(store, "b" * 40, 3.0, 0.10, minutes=1440)
    assert evaluate_nightly(store, good.id, TOLERANCES).status == "baseline", "the NaN run is no baseline"
    assert check_metric(Tolerance("eval/loss", rel=0.02), math.inf, 50.0).note.startswith(
        "the previous nightly's is not a finite number"
    )
    assert check_metric(Tolerance("eval/loss", rel=0.02), None, math.nan).regressed


def test_a_negative_standard_error_is_not_reported_and_does_not_widen_the_tolerance() -> None:
    """`se = -1` (a "not computed" placeholder) made the noise sqrt(2) and the allowance 4.2: a pass."""
    check = check_metric(NOISY, 0.05, 0.07, -1.0, -1.0)
    assert check.regressed and check.noise is None and check.allowed == 0.005, check
    assert "not reported by both runs, so the fixed tolerance applies" in check.note


def test_a_nightly_that_tracks_nothing_cannot_pass(store: LineageStore) -> None:
    """With no tracked metric of its stages a nightly said "passed: 0 tracked metric(s)" and set a
    green commit status: a verdict that guards nothing."""
    run = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    verdict = evaluate_nightly(store, run.id, [])
    assert verdict.status == "regressed" and not verdict.passed
    assert verdict.message.startswith("nightly cannot judge: recipe marin-535b-a23b tracks no metric of the stages")


def test_a_recipe_says_which_way_a_tracked_metric_is_worse(tmp_path: Path) -> None:
    """`worse: higher` for a loss was refused as an unknown key, so every tracked metric was "either"
    and a deliberate improvement failed every later nightly against the old baseline."""
    import yaml

    from orchestrator.recipes import load_recipe, resolve

    data = yaml.safe_load(Path("recipes/marin-535b-a23b.yaml").read_text())
    data["tracked_metrics"]["eval/code/loss"]["worse"] = "higher"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    tracked = {m.name: m for m in resolve(load_recipe(path), "tiny", validate=False).tracked_metrics}
    assert tracked["eval/code/loss"].worse == "higher" and tracked["eval/prose/loss"].worse == "either"
    (tol,) = [t for t in parse_tolerances(tracked.values()) if t.metric == "eval/code/loss"]
    assert not check_metric(tol, 3.0, 2.5).regressed and check_metric(tol, 3.0, 3.5).regressed
    data["tracked_metrics"]["eval/code/loss"]["worse"] = "up"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="worse"):
        resolve(load_recipe(path), "tiny", validate=False)


def test_a_nightly_whose_stage_failed_is_a_regressed_verdict_and_never_a_baseline(store: LineageStore) -> None:
    """A training that diverged and crashed recorded no verdict: no event to page on, no regression
    issue, no commit status; the worst regression said nothing."""
    from orchestrator.nightly import failed_nightly

    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    crashed = plant_run(store, "b" * 40, 3.0, 0.10, minutes=1440, state="FAILED")
    verdict = failed_nightly(store, crashed.id, "stage pretrain failed: exit code 1: loss is NaN")
    assert verdict.status == "regressed" and not verdict.passed and verdict.checks == []
    assert verdict.message.startswith("nightly failed before its verdict: stage pretrain failed: exit code 1")
    assert store.require(PipelineRun, crashed.id).verdict["status"] == "regressed"  # recorded
    later = plant_run(store, "c" * 40, 3.0, 0.10, minutes=2880)
    assert evaluate_nightly(store, later.id, TOLERANCES).previous_run_id == base.id, "judged against the last good"


def test_a_run_that_cannot_be_a_baseline_is_not_accepted(store: LineageStore) -> None:
    """A failed nightly has no numbers to judge the next one against, and one that missed a tracked
    metric would let the next nightly pass that metric unjudged: neither is accepted, and the
    refusal records nothing."""
    from orchestrator.nightly import accept_nightly, failed_nightly

    base = plant_run(store, "a" * 40, 3.0, 0.10, minutes=0)
    evaluate_nightly(store, base.id, TOLERANCES)
    crashed = plant_run(store, "b" * 40, 3.0, 0.10, minutes=10, state="FAILED")
    failed_nightly(store, crashed.id, "stage pretrain failed")
    with pytest.raises(ConfigError, match="is FAILED: a nightly that did not complete"):
        accept_nightly(store, crashed.id, reason="new routing", by="ada@n1")
    partial = _plant(store, "c" * 40, "tiny", {"eval": {"eval/loss": 3.5}}, minutes=20)
    assert evaluate_nightly(store, partial.id, TOLERANCES).status == "regressed"
    with pytest.raises(ConfigError, match="reported no value of moe/drop_fraction"):
        accept_nightly(store, partial.id, reason="new routing", by="ada@n1")
    plain = plant_run(store, "d" * 40, 3.0, 0.10, minutes=30)
    with pytest.raises(ConfigError, match="has no nightly verdict"):
        accept_nightly(store, plain.id, reason="new routing", by="ada@n1")
    for run in (crashed, partial):
        assert not store.require(PipelineRun, run.id).verdict.get("accepted")
    later = plant_run(store, "e" * 40, 3.5, 0.10, minutes=40)
    assert evaluate_nightly(store, later.id, TOLERANCES).previous_run_id == base.id, "still the last good one"
