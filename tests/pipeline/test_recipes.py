"""Recipes: validation names the key path, replicas are the reference times recorded factors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import ConfigError
from orchestrator.recipes import RECIPES_DIR, find_recipe, identity_config, load_recipe, resolve

RECIPE = RECIPES_DIR / "marin-535b-a23b.yaml"


def write(tmp_path: Path, data: object, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def base() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def test_full_recipe_has_the_hero_run_shape() -> None:
    r = resolve("marin-535b-a23b")
    model = r.stage_configs["pretrain"]["model"]
    assert (model["d_model"], model["n_layers"], model["n_experts"], model["top_k"], model["n_shared"]) == (
        6144,
        48,
        384,
        8,
        2,
    )
    assert model["context"] == 4096
    tokens = r.values["tokens"]
    assert tokens["budget"] == 18.75e12 and tokens["pretrain_fraction"] == 0.8 and tokens["midtrain_fraction"] == 0.2
    assert r.values["hardware"]["systems"] == 11 and "NVL72" in r.values["hardware"]["system"]
    tracked = {m.name: m for m in r.tracked_metrics}
    assert tracked["eval/moe/drop_fraction"].absolute == 0.005
    assert tracked["eval/code/loss"].relative == 0.02
    assert tracked["eval/code/loss"].within(2.0, 2.03) and not tracked["eval/code/loss"].within(2.0, 2.05)


def test_tiny_replica_is_the_reference_times_recorded_factors() -> None:
    r = resolve("marin-535b-a23b", "tiny")
    model = r.stage_configs["pretrain"]["model"]
    assert model["d_model"] == 6144 // 96 and model["n_layers"] == 48 // 24 and model["n_experts"] == 384 // 48
    lineage = r.lineage()
    assert lineage["recipe"] == "marin-535b-a23b" and lineage["replica"] == "tiny"
    assert lineage["reference"] == "marin-community/marin#8435"
    assert lineage["scale"]["d_model"] == "1/96" and lineage["scale"]["tokens"] == "1/732421875"
    assert lineage["set"]["data.max_bytes_per_domain"] == 200000
    assert r.derived["pretrain_tokens"] + r.derived["midtrain_tokens"] == 25600
    assert r.derived["pretrain_tokens"] == 4 * r.derived["midtrain_tokens"]  # the 80/20 split survives scaling
    json.dumps(lineage)  # recordable as is
    # runtime placement is in the stage config but not in its identity
    assert r.stage_configs["pretrain"]["threads"] == 2
    assert "threads" not in identity_config(r.stage_configs["pretrain"])
    # each stage gets only the sections it reads: a model change does not touch data/tokenize
    assert set(r.stage_configs["data"]) == {"seed", "data"}
    assert set(r.stage_configs["tokenize"]) == {"seed", "tokenizer"}


def test_a_recipe_stage_may_keep_checkpoint_revisions_and_one_that_does_not_keeps_its_config(tmp_path: Path) -> None:
    data = base()
    data["pretrain"]["keep_every"] = 5000
    r = resolve(write(tmp_path, data), "tiny")
    assert r.stage_configs["pretrain"]["train"]["keep_every"] == 5000
    assert "keep_every" not in r.stage_configs["midtrain"]["train"]  # nor in its identity: unchanged
    assert "keep_every" not in resolve("marin-535b-a23b", "tiny").stage_configs["pretrain"]["train"]
    data["pretrain"]["keep_every"] = "often"
    with pytest.raises(ConfigError, match=r"pretrain.keep_every: expected int"):
        resolve(write(tmp_path, data), "tiny")


def test_small_replica_resolves_and_passes_the_workload_checks() -> None:
    r = resolve("marin-535b-a23b", "small")
    assert r.stage_configs["pretrain"]["model"]["n_experts"] % r.stage_configs["pretrain"]["moe"]["ranks"] == 0
    assert r.derived["pretrain_steps"] > r.derived["midtrain_steps"] > 0


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("model", "experts"), "many", "recipe r.yaml: model.experts: expected int, got str"),
        (("tokens", "budget"), True, "recipe r.yaml: tokens.budget: expected number, got bool"),
        (("dispatch", "scheme"), "warp", "recipe r.yaml: dispatch.scheme: got 'warp'; expected one of: "),
        (("model", "expertz"), 3, "recipe r.yaml: model.expertz: unknown key"),
        (  # a misspelt domain failed in pretrain, after data and tokenize had run
            ("pretrain", "mixture"),
            {"code": 0.5, "prse": 0.5},
            "recipe r.yaml: pretrain.mixture: domain 'prse' is not one of data.domains (code, prose)",
        ),
        (
            ("replicas", "tiny", "scale", "d_model"),
            "one/96",
            "recipe r.yaml: replicas.tiny.scale.d_model: expected a scale",
        ),
        (("replicas", "tiny", "scale", "widths"), 0.5, "recipe r.yaml: replicas.tiny.scale.widths: unknown key"),
        # an infinite or enormous factor was an OverflowError traceback from the fraction or the scaled value
        (("replicas", "tiny", "scale", "tokens"), float("inf"), "replicas.tiny.scale.tokens: expected a scale factor"),
        (("replicas", "tiny", "scale", "tokens"), 1e300, "replicas.tiny.scale.tokens: scale factor must be at most"),
        (
            ("replicas", "tiny", "set"),
            {"model.nope": 1},
            "recipe r.yaml: replicas.tiny.set.model.nope: no such recipe field",
        ),
        (  # a replica's own resources replace the recipe's: a value set there would be ignored
            ("replicas", "tiny", "set"),
            {"resources.default.cpus": 4},
            "recipe r.yaml: replicas.tiny.set.resources.default.cpus: resources is the replica's own",
        ),
        (
            ("replicas", "tiny", "set"),
            {"model.layers": "2"},
            "recipe r.yaml: replicas.tiny.set.model.layers: expected int",
        ),
        (
            ("tracked_metrics", "eval/code/loss", "stage"),
            "nightly",
            "tracked_metrics.eval/code/loss.stage: got 'nightly'; expected one of: data, tokenize",
        ),
        (
            ("tracked_metrics", "eval/code/loss", "sigmas"),
            3,
            "recipe r.yaml: tracked_metrics.eval/code/loss.sigmas: needs stderr",
        ),
    ],
)
def test_validation_errors_name_the_key_path(
    tmp_path: Path, path: tuple[str, ...], value: object, message: str
) -> None:
    assert message in _refusal_of(tmp_path, path, value)


def _refusal_of(tmp_path: Path, path: tuple[str, ...], value: object) -> str:
    """The error loading the base recipe with ``value`` at ``path`` gives."""
    data = base()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, data))
    return str(err.value)


def test_a_tracked_metric_without_a_tolerance_is_refused_by_the_verdicts_rule(tmp_path: Path) -> None:
    """Recipe loading applies the nightly verdict's own tolerance rules, so the two cannot disagree."""
    data = base()
    del data["tracked_metrics"]["eval/code/loss"]["relative"]
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, data))
    assert str(err.value) == (
        "recipe r.yaml: tracked_metrics.eval/code/loss: give a tolerance: rel (relative) and/or abs (absolute)"
    )


def test_missing_key_and_bad_split_and_unknown_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = base()
    del data["model"]["top_k"]
    with pytest.raises(ConfigError, match=r"model\.top_k: missing"):
        load_recipe(write(tmp_path, data))
    data = base()
    data["tokens"]["midtrain_fraction"] = 0.3
    with pytest.raises(ConfigError, match="pretrain_fraction \\+ midtrain_fraction must be 1"):
        load_recipe(write(tmp_path, data))
    with pytest.raises(ConfigError, match="no replica 'huge'.*tiny, small"):
        resolve("marin-535b-a23b", "huge")
    with pytest.raises(ConfigError, match="no recipe of that name"):
        load_recipe("no-such-recipe")
    # a folder is not "no such file": it exists, it is just not a recipe
    with pytest.raises(ConfigError, match=r"is a folder, not a recipe; give one of its recipes \(marin-535b"):
        find_recipe(RECIPES_DIR)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"is a folder, not a recipe; give a recipe file \(a \.yaml\)"):
        find_recipe(tmp_path / "empty")
    # a folder in the working directory named like a recipe (an output folder, say) does not hide it
    (tmp_path / "marin-535b-a23b").mkdir()
    monkeypatch.chdir(tmp_path)
    assert find_recipe("marin-535b-a23b") == RECIPES_DIR / "marin-535b-a23b.yaml"


def test_yaml_1_1_integers_and_a_key_given_twice_are_not_read_silently(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 rules read `steps: 010` as 8 and `1:30` as 90 (base 60), and a second `train:`
    replaced the first: a recipe ran with values nobody wrote. Such text stays text (refused where a
    number goes), and a key given twice is refused naming it."""
    from orchestrator.recipes.schema import load_yaml

    assert load_yaml("a: 010\nb: 1:30\nc: 10\nd: 0x1f\ne: 1_000\nf: 1e-4") == {
        "a": "010",
        "b": "1:30",
        "c": 10,
        "d": 31,
        "e": 1000,
        "f": 0.0001,
    }
    data = base()
    text = yaml.safe_dump(data) + "name: again\n"  # `name:` twice
    with pytest.raises(ConfigError, match="invalid YAML: found the key 'name' twice in one mapping; keep one"):
        load_recipe(write(tmp_path, text))


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"name: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_recipe(write(tmp_path, text))
    assert not marker.exists()


def test_workload_checks_run_before_any_job(tmp_path: Path) -> None:
    data = base()
    data["replicas"]["tiny"]["scale"]["ranks"] = "1/10"  # 64/10 -> 6 ranks: 8 experts do not split
    with pytest.raises(ConfigError, match="replica tiny: stage pretrain: .*divisible"):
        resolve(load_recipe(write(tmp_path, data)), "tiny")


def test_explain_cli_json(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from orchestrator.cli.run import app; app()",
            "explain",
            "marin-535b-a23b",
            "--replica",
            "tiny",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [s["stage"] for s in doc["stages"]] == ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]
    assert doc["stages"][0]["action"] == "run" and doc["recipe"]["replica"] == "tiny"


# -- the drop-fraction reproduction as a replica (issue 6: runnable on its own and through the flows) ----


def test_drops_replica_is_the_shipped_reproduction_config() -> None:
    """`marin-535b-a23b --replica drops` resolves, stage by stage, to what `recipes/moe-repro.yaml` gives the
    workload on its own, so the documented runs and a run through the flows measure the same experiment."""
    from workloads.moe.config import load_config, parse_config

    r = resolve("marin-535b-a23b", "drops")
    assert r.stages == ("data", "tokenize", "repro") and list(r.stage_configs) == list(r.stages)
    alone = load_config(RECIPES_DIR / "moe-repro.yaml")
    read = {
        "data": ("seed", "data"),
        "tokenize": ("seed", "tokenizer"),
        "repro": ("seed", "device", "threads", "model", "moe", "train", "repro"),
    }
    for stage, sections in read.items():
        piped = parse_config({**r.stage_configs[stage], "inputs": {}})
        for section in sections:
            assert getattr(piped, section) == getattr(alone, section), (stage, section)
    # the scale factors land on Marin's per-rank shape: 6 experts per rank, top-8, 4096 tokens
    model = r.stage_configs["repro"]["model"]
    assert model["n_experts"] // r.stage_configs["repro"]["moe"]["ranks"] == 6 and model["top_k"] == 8
    assert r.lineage()["stages"] == ["data", "tokenize", "repro"] and r.derived["repro_steps"] == 150
    # only the reproduction's tracked metrics apply to it; the training chain keeps its own
    assert {m.stage for m in r.tracked_metrics} == {"repro"}
    assert "repro/pooled_wave_1.15_1.15/late_median_drop" in {m.name for m in r.tracked_metrics}
    # The reproduction's medians are noise-scaled: 3 standard errors of the difference, 0.5 points at least.
    pw = {m.name: m for m in r.tracked_metrics}["repro/pooled_wave_1.15_1.15/late_median_drop"]
    assert (pw.stderr, pw.sigmas) == ("repro/pooled_wave_1.15_1.15/late_median_drop_se", 3)
    assert not pw.within(0.0482, 0.0535) and pw.within(0.0482, 0.0535, 0.0072, 0.0075)
    assert not pw.within(0.0482, 0.0982, 0.0072, 0.0080)
    assert {m.stage for m in resolve("marin-535b-a23b", "tiny").tracked_metrics} == {"eval"}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"stages": ["data", "repro"]}, "stage 'repro' reads 'tokens' from stage 'tokenize'; add 'tokenize'"),
        ({"stages": ["data", "tokenize", "finetune"]}, "stages[2]: got 'finetune'; expected one of: data, tokenize"),
        ({"stages": ["data", "tokenize", "tokenize"]}, "a stage is named twice"),
        ({"stages": ["data", "tokenize", "pretrain"]}, "has a repro section but its stages do not include repro"),
        ({"repro": None}, "stage repro needs a repro section"),
        ({"repro": {"train": {"steps": 10}, "measure": {}}}, "repro.train.batch_sequences: missing"),
        (
            {
                "repro": {
                    "train": {"steps": 5, "batch_sequences": 4, "lr": 0.01},
                    "measure": {"train_arm": "nope", "arms": []},
                }
            },
            "stage repro: ",
        ),
    ],
)
def test_bad_replica_stages_or_repro_section_is_one_line_before_any_job(
    tmp_path: Path, edit: dict, message: str
) -> None:
    data = base()
    replica = data["replicas"]["drops-tiny"]
    for key, value in edit.items():
        if value is None:
            del replica[key]
        else:
            replica[key] = value
    with pytest.raises(ConfigError) as err:
        resolve(load_recipe(write(tmp_path, data)), "drops-tiny")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_explain_lists_the_replicas_own_stages() -> None:
    from orchestrator.pipeline import explain_recipe

    plans = explain_recipe("marin-535b-a23b", "drops-tiny")
    assert [p.stage for p in plans] == ["data", "tokenize", "repro"]


def test_stage_resources_reach_the_jobs_and_never_the_identity(tmp_path: Path) -> None:
    """A replica's `resources` become each stage's job request (its own entry over `default`), are
    recorded with the recipe, and asking for more does not re-run anything."""
    from orchestrator.identity import compute_identity
    from orchestrator.pipeline.dag import moe_pipeline

    tiny = resolve("marin-535b-a23b", "tiny")
    pipeline = moe_pipeline(stages=tiny.stages, resources=tiny.resources)
    asked = {s.name: (s.cpus, s.memory, s.gpus, s.time_limit) for s in pipeline.stages}
    assert asked["pretrain"] == (2, "4G", 0, 1800)  # its own memory and time over the default's
    assert asked["eval"] == (2, "3G", 0, 900)  # the default
    assert tiny.lineage()["resources"]["pretrain"] == {"cpus": 2, "memory": "4G", "time_limit": 1800}
    assert resolve("marin-535b-a23b", "drops-tiny").resources == {}  # none given: the backend's defaults

    data = base()
    data["replicas"]["tiny"]["resources"]["default"]["slurm"] = {"account": "marin", "partition": "cpu"}
    data["replicas"]["tiny"]["resources"]["pretrain"] = {
        "gpus": 8,
        "memory": "1T",
        "time_limit": 86400,
        "slurm": {"partition": "gpu"},
    }
    bigger = resolve(load_recipe(write(tmp_path, data)), "tiny")
    assert bigger.resources["pretrain"]["gpus"] == 8
    # Slurm options merge key by key: pretrain's partition over the default's, the account kept
    assert bigger.resources["pretrain"]["slurm"] == {"account": "marin", "partition": "gpu"}
    specs = {s.name: s for s in moe_pipeline(stages=bigger.stages, resources=bigger.resources).stages}
    assert specs["pretrain"].backend_options == {"slurm": {"account": "marin", "partition": "gpu"}}
    assert specs["data"].backend_options == {"slurm": {"account": "marin", "partition": "cpu"}}
    # Kubernetes placement the same way: the GPU pool and its taint for pretrain, the namespace for all
    data["replicas"]["tiny"]["resources"]["default"]["kubernetes"] = {"namespace": "training"}
    data["replicas"]["tiny"]["resources"]["pretrain"]["kubernetes"] = {
        "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priority_class": "training-high",
    }
    pooled = resolve(load_recipe(write(tmp_path, data)), "tiny")
    specs = {s.name: s for s in moe_pipeline(stages=pooled.stages, resources=pooled.resources).stages}
    assert specs["pretrain"].backend_options["kubernetes"] == {
        "namespace": "training",
        "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priority_class": "training-high",
    }
    assert specs["eval"].backend_options["kubernetes"] == {"namespace": "training"}
    data["replicas"]["tiny"]["resources"]["pretrain"]["docker"] = {"shm_size": "2G", "mounts": {"/data": "/data:ro"}}
    boxed = resolve(load_recipe(write(tmp_path, data)), "tiny")
    specs = {s.name: s for s in moe_pipeline(stages=boxed.stages, resources=boxed.resources).stages}
    assert specs["pretrain"].backend_options["docker"] == {"shm_size": "2G", "mounts": {"/data": "/data:ro"}}
    data["replicas"]["tiny"]["resources"]["pretrain"]["backend"] = "slurm"
    placed = resolve(load_recipe(write(tmp_path, data)), "tiny")
    specs = {s.name: s for s in moe_pipeline(stages=placed.stages, resources=placed.resources).stages}
    assert (specs["pretrain"].backend, specs["data"].backend) == ("slurm", None)
    assert [identity_config(c) for c in bigger.stage_configs.values()] == [
        identity_config(c) for c in tiny.stage_configs.values()
    ]
    assert compute_identity("pretrain", identity_config(bigger.stage_configs["pretrain"])).digest == (
        compute_identity("pretrain", identity_config(tiny.stage_configs["pretrain"])).digest
    )


def test_a_training_stage_is_warned_ahead_of_its_time_limit_as_long_as_its_recipe_says(tmp_path: Path) -> None:
    """A tenth of the limit ahead, at most five minutes, unless the recipe says how long its
    checkpoint takes to write (or 0: no warning); a stage that saves nothing is never warned."""
    from orchestrator.pipeline.checkpoints import warn_before_limit
    from orchestrator.pipeline.dag import moe_pipeline

    def warnings(resources: dict) -> dict[str, int | None]:
        data = base()
        data["replicas"]["tiny"]["resources"] = resources
        resolved = resolve(load_recipe(write(tmp_path, data)), "tiny")
        return {
            s.name: warn_before_limit(s)
            for s in moe_pipeline(stages=resolved.stages, resources=resolved.resources).stages
        }

    by_default = warnings({"default": {"time_limit": 900}, "pretrain": {"time_limit": 86400}})
    assert by_default == {
        "data": None,
        "tokenize": None,
        "pretrain": 300,
        "midtrain": 90,
        "posttrain": 90,
        "eval": None,
    }
    told = warnings({"default": {"time_limit": 900}, "pretrain": {"time_limit": 86400, "warn_before_limit": 1200}})
    assert told["pretrain"] == 1200 and told["midtrain"] == 90
    off = warnings({"default": {"time_limit": 900, "warn_before_limit": 0}})
    assert set(off.values()) == {None}
    # written as a Slurm user writes --time (a day count reads hours next), or as 10m
    slurm_style = warnings(
        {"default": {"time_limit": "15:00"}, "pretrain": {"time_limit": "1-00", "warn_before_limit": "10m"}}
    )
    assert slurm_style == {**by_default, "pretrain": 600}
    data = base()
    data["replicas"]["tiny"]["resources"] = {"pretrain": {"time_limit": "1-02:30"}}
    assert resolve(load_recipe(write(tmp_path, data)), "tiny").resources["pretrain"]["time_limit"] == 95400
    assert set(warnings({}).values()) == {None}, "no time limit, nothing to warn of"


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"pretrian": {"gpus": 1}}, "replicas.tiny.resources.pretrian: not a stage this runs"),
        ({"repro": {"gpus": 1}}, "replicas.tiny.resources.repro: not a stage this runs"),
        ({"pretrain": {"memory": "lots"}}, "replicas.tiny.resources.pretrain.memory: invalid 'lots'"),
        ({"pretrain": {"memory": "4096"}}, "replicas.tiny.resources.pretrain.memory: memory '4096' has no unit"),
        ({"pretrain": {"memory": "0"}}, "replicas.tiny.resources.pretrain.memory: memory '0' is under 6M"),
        (
            {"pretrain": {"slurm": {"extra_args": ["--exclusive", "--export=NONE"]}}},
            "replicas.tiny.resources.pretrain.slurm.extra_args '--export=NONE': --export is not for extra_args",
        ),
        ({"default": {"cpus": 0}}, "replicas.tiny.resources.default.cpus: must be positive"),
        ({"eval": {"time_limit": -5}}, "replicas.tiny.resources.eval.time_limit: seconds, must be positive"),
        (
            {"eval": {"time_limit": "2 days"}},
            "replicas.tiny.resources.eval.time_limit: invalid time limit '2 days': use seconds, MM:SS, HH:MM:SS, D-HH,",
        ),
        ({"eval": {"time_limit": 1.5}}, "replicas.tiny.resources.eval.time_limit: expected seconds or a duration"),
        (
            {"pretrain": {"time_limit": 1800, "warn_before_limit": 1800}},
            "replicas.tiny.resources.pretrain.warn_before_limit: seconds ahead of the stage's time_limit (1800), "
            "so 0 (no warning) or under it, got 1800",
        ),
        (
            {"default": {"time_limit": 600, "warn_before_limit": -1}},
            "replicas.tiny.resources.default.warn_before_limit: seconds ahead",
        ),
        (
            {"pretrain": {"warn_before_limit": 60}},
            "replicas.tiny.resources.pretrain.warn_before_limit: stage pretrain has no time_limit to be warned ahead",
        ),
        ({"eval": {"gpu": 1}}, "replicas.tiny.resources.eval.gpu: unknown key"),
        ({"pretrain": {"tasks_per_node": 0}}, "replicas.tiny.resources.pretrain.tasks_per_node: must be 1 or more"),
        ({"eval": {"nodes": 2}}, "replicas.tiny.resources.eval: stage eval runs as one task; only pretrain, midtrain"),
        ({"default": {"tasks_per_node": 2}}, "replicas.tiny.resources.default: stage data runs as one task"),
        ({"eval": {"gpus": "one"}}, "replicas.tiny.resources.eval.gpus: expected int"),
        ({"eval": {"slurm": {"partiton": "gpu"}}}, "replicas.tiny.resources.eval.slurm.partiton: unknown key"),
        (
            {"pretrain": {"backend": "ray"}},
            "replicas.tiny.resources.pretrain.backend: got 'ray'; expected one of: local, docker",
        ),
        ({"pretrain": {"docker": {"shm_size": "lots"}}}, "replicas.tiny.resources.pretrain.docker.shm_size: invalid"),
        ({"pretrain": {"docker": {"shm": "2G"}}}, "replicas.tiny.resources.pretrain.docker.shm: unknown key"),
        (
            {"pretrain": {"kubernetes": {"nodeSelector": {"a": "b"}}}},
            "replicas.tiny.resources.pretrain.kubernetes.nodeSelector: unknown key; "
            "did you mean 'node_selector'? known: ",
        ),
        (
            {"pretrain": {"kubernetes": {"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}}},
            "replicas.tiny.resources.pretrain.kubernetes.tolerations[0].efect: unknown key",
        ),
        (
            {"pretrain": {"kubernetes": {"tolerations": [{"key": "gpu", "operator": "Equals"}]}}},
            "kubernetes.tolerations[0].operator: got 'Equals'; did you mean 'Equal'? expected one of: Exists, Equal",
        ),
    ],
)
def test_bad_stage_resources_are_one_line_before_any_job(tmp_path: Path, resources: dict, message: str) -> None:
    data = base()
    data["replicas"]["tiny"]["resources"] = resources
    with pytest.raises(ConfigError) as err:
        resolve(load_recipe(write(tmp_path, data)), "tiny")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_until_keeps_a_stage_and_what_it_reads_from_with_their_configs() -> None:
    tiny = resolve("marin-535b-a23b", "tiny")
    assert tiny.until(None) is tiny
    prep = tiny.until("tokenize")
    assert prep.stages == ("data", "tokenize") and set(prep.stage_configs) == {"data", "tokenize"}
    assert prep.stage_configs["tokenize"] == tiny.stage_configs["tokenize"]  # same identity as in a full run
    assert set(prep.resources) == {"data", "tokenize"} and prep.tracked_metrics == ()
    assert resolve("marin-535b-a23b", "drops").until("repro").stages == ("data", "tokenize", "repro")
    with pytest.raises(ConfigError, match=r"--until 'repro': not a stage of this run; stages: data, tokenize,"):
        tiny.until("repro")


def test_a_run_of_another_tree_reads_that_trees_recipe(tmp_path: Path) -> None:
    """A flow run of an older git ref executes that commit's code, so it must use that commit's recipe."""
    data = base()
    data["replicas"]["tiny"]["set"]["data.max_bytes_per_domain"] = 123456
    (tmp_path / "recipes").mkdir()
    write(tmp_path / "recipes", data, "marin-535b-a23b.yaml")
    theirs = resolve("marin-535b-a23b", "tiny", root=tmp_path)
    assert theirs.recipe.path == (tmp_path / "recipes" / "marin-535b-a23b.yaml").resolve()
    assert theirs.stage_configs["data"]["data"]["max_bytes_per_domain"] == 123456
    assert resolve("recipes/marin-535b-a23b.yaml", "tiny", root=tmp_path).recipe.path == theirs.recipe.path
    assert resolve("marin-535b-a23b", "tiny").stage_configs["data"]["data"]["max_bytes_per_domain"] == 200000


def test_the_ui_forms_stage_choices_and_the_dag_are_the_recipe_stages() -> None:
    from typing import get_args

    from flows.pipeline import Stage
    from orchestrator.pipeline.dag import MOE_STAGE_INPUTS
    from orchestrator.recipes import STAGES

    assert get_args(Stage) == STAGES
    assert tuple(MOE_STAGE_INPUTS) == STAGES  # a stage a recipe names is one the DAG knows how to feed


def test_preregistered_predictions_travel_with_the_recipe_and_follow_its_stages(tmp_path: Path) -> None:
    tiny = resolve("marin-535b-a23b", "tiny")
    (loss,) = tiny.preregistered
    assert (loss.metric, loss.stage, loss.value, loss.tolerance) == ("eval/code/loss", "eval", 5.3, 0.4)
    assert tiny.lineage()["preregistered"][0]["value"] == 5.3  # recorded when the run starts
    assert tiny.until("tokenize").preregistered == ()  # a cut run cannot measure it
    assert resolve("marin-535b-a23b", "small").preregistered == ()  # a replica's own, not inherited
    data = base()
    data["replicas"]["tiny"]["preregistered"]["eval/code/loss"]["tolerance"] = -1
    with pytest.raises(ConfigError, match=r"preregistered\.eval/code/loss\.tolerance: must be 0 or more"):
        resolve(load_recipe(write(tmp_path, data)), "tiny")
    data["replicas"]["tiny"]["preregistered"]["eval/code/loss"] = {"stage": "evaluate", "value": 5, "tolerance": 1}
    said = r"preregistered\.eval/code/loss\.stage: got 'evaluate'; did you mean 'eval'\? expected one of: "
    with pytest.raises(ConfigError, match=said):
        load_recipe(write(tmp_path, data))


# -- `openlab run --set` / the flow's `overrides`: one run's values over its recipe --------------------


def test_a_value_set_for_one_run_configures_its_stages_as_the_same_value_in_the_recipe_would(
    tmp_path: Path,
) -> None:
    """A `--set` is an experiment without a new recipe file: its stages get the configs (so the
    identities, so what is reused) that writing the value into the replica's `set` gives, it wins
    over the replica's own `set`, it is taken as written (not scaled), and the run records it apart
    from the recipe's values."""
    from orchestrator.recipes import parse_sets

    sets = parse_sets(["pretrain.lr=0.02", "model.d_model=128", "pretrain.mixture={code: 0.5, prose: 0.5}"])
    assert sets == {"pretrain.lr": 0.02, "model.d_model": 128, "pretrain.mixture": {"code": 0.5, "prose": 0.5}}
    by_hand = base()
    by_hand["replicas"]["tiny"]["set"].update(sets)
    edited = resolve(load_recipe(write(tmp_path, by_hand)), "tiny")
    set_here = resolve("marin-535b-a23b", "tiny", sets=sets)
    assert set_here.stage_configs == edited.stage_configs
    assert {s: identity_config(c) for s, c in set_here.stage_configs.items()} != {
        s: identity_config(c) for s, c in resolve("marin-535b-a23b", "tiny").stage_configs.items()
    }
    pretrain = set_here.stage_configs["pretrain"]
    assert pretrain["train"]["lr"] == 0.02  # over the replica's own pretrain.lr: 0.01
    assert pretrain["model"]["d_model"] == 128  # as written: the tiny scale (1/96) would make 128 into 1
    lineage = set_here.lineage()
    assert lineage["run_set"] == sets and lineage["set"]["pretrain.lr"] == 0.01
    assert resolve("marin-535b-a23b", "tiny").lineage()["run_set"] == {}
    # the reproduction's own section, on a replica that has one
    drops = resolve("marin-535b-a23b", "drops-tiny", sets={"repro.train.lr": 0.02})
    assert drops.stage_configs["repro"]["train"]["lr"] == 0.02
    assert resolve("marin-535b-a23b", "drops-tiny").stage_configs["repro"]["train"]["lr"] == 0.01  # not changed


@pytest.mark.parametrize(
    ("replica", "items", "message"),
    [
        ("tiny", ["pretrain.lrr=0.02"], "--set pretrain.lrr: no such recipe field; did you mean 'pretrain.lr'?"),
        ("tiny", ["pretrain.foo=1"], "--set pretrain.foo: no such recipe field; fields of pretrain: pretrain.lr,"),
        ("tiny", ["bogus.x=1"], "--set bogus.x: no such recipe field; sections: seed, model,"),
        ("tiny", ["pretrain=1"], "--set pretrain: a section, not a value; set one of: pretrain.lr,"),
        ("tiny", ["pretrain.lr=fast"], "--set pretrain.lr: expected number, got str"),
        ("tiny", ["dispatch.scheme=warp"], "--set dispatch.scheme: got 'warp'; expected one of: dropless,"),
        # a replica's own resources and predictions replace the recipe's: a value set there would be ignored
        ("tiny", ["resources.default.cpus=4"], "--set resources.default.cpus: resources is the replica's own"),
        ("tiny", ["name=other"], "--set name: name names the recipe and cannot be set"),
        ("tiny", ["repro.train.lr=0.1"], "--set repro.train.lr: no such recipe field"),  # tiny has no repro
        ("drops-tiny", ["repro.train.stepz=3"], "--set repro.train.stepz: no such recipe field; did you mean"),
        # the workload's own checks see the value too, before any job
        ("tiny", ["model.top_k=16"], "stage pretrain:"),
        # and the rules that tie one recipe value to another (a mixture of a domain the data lacks
        # failed in pretrain, after data and tokenize had run)
        ("tiny", ["tokens.pretrain_fraction=0.9"], "tokens: pretrain_fraction + midtrain_fraction must be 1, got 1.1"),
        ("tiny", ["data.domains={code: 'stdlib:code'}"], "pretrain.mixture: domain 'prose' is not one of data.domains"),
        ("drops-tiny", ["repro.train.mixture={legal: 1}"], "repro.train.mixture: domain 'legal' is not one of"),
        ("tiny", ["pretrain.lr"], "--set 'pretrain.lr': expected KEY=VALUE"),
        ("tiny", ["=1"], "--set '=1': expected KEY=VALUE"),
        ("tiny", ["pretrain.lr=[1"], "--set pretrain.lr: cannot read the value '[1'"),
    ],
)
def test_a_bad_set_is_one_line_naming_the_key_before_anything_runs(replica: str, items: list, message: str) -> None:
    from orchestrator.recipes import parse_sets

    with pytest.raises(ConfigError) as err:
        resolve("marin-535b-a23b", replica, sets=parse_sets(items))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("replica", "item", "message"),
    [
        # a batch of no sequences divided the token budget by zero: a traceback, not an error
        (
            "tiny",
            "tokens.batch_sequences=0",
            "--set tokens.batch_sequences: must be 1 or more (sequences per step), got 0",
        ),
        ("tiny", "model.context=0", "--set model.context: must be 1 or more (tokens per sequence), got 0"),
        ("tiny", "pretrain.lr=-1", "--set pretrain.lr: must be positive (the peak learning rate), got -1"),
        ("tiny", "pretrain.lr=0", "--set pretrain.lr: must be positive (the peak learning rate), got 0"),
        # a budget of no tokens was clamped to one step, a checkpoint every 0 steps to every step
        (
            "tiny",
            "tokens.budget=-1",
            "--set tokens.budget: must be positive (the tokens of pretrain and midtrain), got -1",
        ),
        (
            "tiny",
            "tokens.budget=0",
            "--set tokens.budget: must be positive (the tokens of pretrain and midtrain), got 0",
        ),
        ("tiny", "pretrain.checkpoint_every=0", "--set pretrain.checkpoint_every: must be 1 or more (steps between"),
        ("tiny", "eval.batches=-3", "--set eval.batches: must be 1 or more (held-out batches per domain), got -3"),
        ("tiny", "pretrain.warmup_fraction=5", "--set pretrain.warmup_fraction: must be in [0, 1] (the share of"),
        # torch clips to the norm given: 0 zeroes every gradient, below 0 flips them
        (
            "tiny",
            "pretrain.grad_clip=-1",
            "--set pretrain.grad_clip: must be positive (the largest gradient norm kept;",
        ),
        ("tiny", "midtrain.grad_clip=0", "--set midtrain.grad_clip: must be positive (the largest gradient norm kept;"),
        ("tiny", "pretrain.weight_decay=-1", "--set pretrain.weight_decay: must be 0 or more (AdamW's weight decay"),
        ("tiny", "pretrain.min_lr_ratio=-1", "--set pretrain.min_lr_ratio: must be in [0, 1] (the final learning rate"),
        ("tiny", "posttrain.lr=-0.5", "--set posttrain.lr: must be positive (the peak learning rate), got -0.5"),
        ("tiny", "posttrain.tokens=-1", "--set posttrain.tokens: must be positive (the tokens of posttrain), got -1"),
        ("tiny", "pretrain.keep_every=-2", "--set pretrain.keep_every: must be 0 or more"),
        ("tiny", "pretrain.mixture={code: -1, prose: 2}", "--set pretrain.mixture.code: must be 0 or more"),
        ("tiny", "tokens.midtrain_fraction=1.5", "--set tokens.midtrain_fraction: must be in [0, 1]"),
        ("tiny", "data.heldout_fraction=1", "--set data.heldout_fraction: must be in (0, 1)"),
        ("tiny", "data.max_bytes_per_domain=0", "--set data.max_bytes_per_domain: must be 1 or more"),
        ("tiny", "tokenizer.vocab_size=100", "--set tokenizer.vocab_size: must be 300 or more"),
        ("tiny", "model.layers=0", "--set model.layers: must be 1 or more (transformer layers), got 0"),
        ("tiny", "model.shared_experts=-1", "--set model.shared_experts: must be 0 or more"),
        ("tiny", "model.attn_window=-64", "--set model.attn_window: must be 0 or more"),
        ("tiny", "model.rope_theta=0.5", "--set model.rope_theta: must be more than 1 (the RoPE base"),
        ("tiny", "routing.aux_loss_coef=-0.01", "--set routing.aux_loss_coef: must be 0 or more"),
        ("tiny", "dispatch.ranks=0", "--set dispatch.ranks: must be 1 or more"),
        ("tiny", "dispatch.capacity_factor=0", "--set dispatch.capacity_factor: must be positive"),
        ("tiny", "dispatch.waves=0", "--set dispatch.waves: must be 1 or more"),
        ("tiny", "seed=-1", "--set seed: must be 0 or more (the run's random seed), got -1"),
        ("tiny", "hardware.systems=0", "--set hardware.systems: must be 1 or more"),
        ("drops-tiny", "repro.train.grad_clip=0", "--set repro.train.grad_clip: must be positive"),
        ("drops-tiny", "repro.train.steps=0", "--set repro.train.steps: must be 1 or more (training steps), got 0"),
        ("drops-tiny", "repro.train.warmup_steps=-1", "--set repro.train.warmup_steps: must be 0 or more"),
        ("drops-tiny", "repro.train.batch_sequences=0", "--set repro.train.batch_sequences: must be 1 or more"),
    ],
)
def test_a_value_out_of_its_range_is_one_line_naming_the_key_the_value_and_the_range(
    replica: str, item: str, message: str
) -> None:
    """A nonsensical number (a negative learning rate, a batch of no sequences) is refused by the
    schema's range for its key, before any stage config is computed from it (a batch of 0 divided
    by zero) or clamped to something that runs (a budget of -1 tokens ran one step)."""
    from orchestrator.recipes import parse_sets

    with pytest.raises(ConfigError) as err:
        resolve("marin-535b-a23b", replica, sets=parse_sets([item]))
    said = str(err.value)
    assert said.startswith("recipe marin-535b-a23b.yaml: ") and message in said and "\n" not in said, said


def test_a_sweeps_grid_value_out_of_range_names_the_grid() -> None:
    from orchestrator.recipes import parse_grid, sweep_trials

    for trial in sweep_trials(parse_grid(["pretrain.lr=0.01,-1"])):
        if trial["pretrain.lr"] > 0:
            resolve("marin-535b-a23b", "tiny", sets=trial, sets_from={"pretrain.lr": "--grid"})
            continue
        with pytest.raises(ConfigError) as err:
            resolve("marin-535b-a23b", "tiny", sets=trial, sets_from={"pretrain.lr": "--grid"})
        assert "--grid pretrain.lr: must be positive (the peak learning rate), got -1" in str(err.value)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("pretrain", "lr"), 0, "recipe r.yaml: pretrain.lr: must be positive (the peak learning rate), got 0"),
        (("tokens", "batch_sequences"), 0, "recipe r.yaml: tokens.batch_sequences: must be 1 or more"),
        (("midtrain", "mixture", "prose"), -0.3, "recipe r.yaml: midtrain.mixture.prose: must be 0 or more"),
        (("posttrain", "warmup_fraction"), 1.01, "recipe r.yaml: posttrain.warmup_fraction: must be in [0, 1]"),
        (("replicas", "tiny", "set"), {"eval.batches": 0}, "recipe r.yaml: replicas.tiny.set.eval.batches: must be 1"),
        (("replicas", "tiny", "runtime", "threads"), -2, "recipe r.yaml: replicas.tiny.runtime.threads: must be 0 or"),
        (
            ("replicas", "drops-tiny", "repro", "train", "lr"),
            -0.01,
            "recipe r.yaml: replicas.drops-tiny.repro.train.lr: must be positive",
        ),
        # the ranges a job's resources had in stage_resources are the schema's too, same words
        (
            ("replicas", "small", "resources"),
            {"eval": {"gpus": -1}},
            "replicas.small.resources.eval.gpus: must be 0 or",
        ),
        (
            ("replicas", "tiny", "resources", "default", "cpus"),
            0,
            "replicas.tiny.resources.default.cpus: must be posit",
        ),
    ],
)
def test_a_recipe_file_value_out_of_its_range_is_refused_when_the_file_loads(
    tmp_path: Path, path: tuple[str, ...], value: object, message: str
) -> None:
    said = _refusal_of(tmp_path, path, value)
    assert message in said and "\n" not in said, said


def test_the_ends_of_each_range_that_mean_something_are_allowed(tmp_path: Path) -> None:
    """0 where the workload reads it as "none" or "off" (weight decay, warmup, a final learning rate
    of 0, full attention, no shared experts, no kept revisions) and 1 where a share may be all."""
    sets = {
        "pretrain.weight_decay": 0,
        "pretrain.warmup_fraction": 0,
        "midtrain.warmup_fraction": 1,
        "pretrain.min_lr_ratio": 0,
        "midtrain.min_lr_ratio": 1,
        "pretrain.keep_every": 0,
        "model.attn_window": 0,
        "routing.aux_loss_coef": 0,
        "pretrain.mixture": {"code": 1, "prose": 0},
        "seed": 0,
    }
    tiny = resolve("marin-535b-a23b", "tiny", sets=sets)
    assert tiny.stage_configs["pretrain"]["model"]["attn_window"] == 0
    assert tiny.stage_configs["pretrain"]["train"]["weight_decay"] == 0
    # a count of 0 ("none") stays 0 under a replica's scale factor: it was made 1 shared expert
    data = base()
    data["model"]["shared_experts"] = 0
    data["model"]["attn_window"] = 0
    model = resolve(load_recipe(write(tmp_path, data)), "tiny").stage_configs["pretrain"]["model"]
    assert (model["n_shared"], model["attn_window"]) == (0, 0)


def test_a_recipe_that_is_not_utf8_is_one_line_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfen\x00a\x00m\x00e\x00")  # UTF-16, as some editors save
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert str(err.value) == "recipe bin.yaml: not UTF-8 text (byte 0xff at offset 0); save the file as UTF-8"


def test_the_cli_refuses_a_value_out_of_range_and_a_file_not_utf8_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfen\x00")
    for args, said in (
        (
            ["marin-535b-a23b", "--replica", "tiny", "--set", "tokens.batch_sequences=0"],
            "error: recipe marin-535b-a23b.yaml: --set tokens.batch_sequences: must be 1 or more (sequences per "
            "step), got 0",
        ),
        ([str(tmp_path / "bin.yaml"), "--replica", "tiny"], "error: recipe bin.yaml: not UTF-8 text"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", "from orchestrator.cli.main import main; main()", "explain", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, (out.returncode, out.stderr)
        assert out.stderr.startswith(said) and out.stderr.count("\n") == 1, out.stderr
        assert "Traceback" not in out.stderr and out.stdout == "", out.stdout


def test_every_replica_of_every_shipped_recipe_still_resolves() -> None:
    """The shipped recipes sit inside every range, at full scale and at each replica's scale."""
    recipes = [p for p in sorted(RECIPES_DIR.glob("*.yaml")) if "name" in (yaml.safe_load(p.read_text()) or {})]
    assert recipes
    for path in recipes:
        recipe = load_recipe(path)
        resolve(recipe, None, validate=False)
        for replica in recipe.replicas:
            resolve(recipe, replica)


def test_a_sweeps_grid_is_every_combination_over_the_values_fixed_for_all() -> None:
    from orchestrator.recipes import MAX_TRIALS, sweep_trials

    trials = sweep_trials({"pretrain.lr": [0.01, 0.02], "seed": [0, 1, 2]}, {"pretrain.warmup_fraction": 0.1})
    assert [(t["pretrain.lr"], t["seed"]) for t in trials] == [(a, b) for a in (0.01, 0.02) for b in (0, 1, 2)]
    assert all(t["pretrain.warmup_fraction"] == 0.1 for t in trials)
    for grid, fixed, message in (
        ({}, None, "sweep: give a grid of values to try"),
        ({"pretrain.lr": 0.01}, None, "sweep: pretrain.lr: give a list of the values to try"),
        ({"pretrain.lr": []}, None, "sweep: pretrain.lr: give a list of the values to try"),
        ({"pretrain.lr": [0.01]}, {"pretrain.lr": 0.02}, "sweep: pretrain.lr is both swept and set for every run"),
        ({"seed": list(range(MAX_TRIALS + 1))}, None, f"sweep: {MAX_TRIALS + 1} runs"),
        ({"seed": [0, 1, 0]}, None, "sweep: seed: the value 0 is given twice"),
        ({"pretrain.lr": [0.01, 1e-2]}, None, "sweep: pretrain.lr: the value 0.01 is given twice"),
    ):
        with pytest.raises(ConfigError, match=message):
            sweep_trials(grid, fixed)


def test_grid_values_are_a_yaml_list_whose_brackets_may_be_left_out() -> None:
    """`--grid pretrain.lr=0.005,0.01` as Hydra's multirun takes it; brackets, words and mappings too."""
    from orchestrator.recipes import parse_grid

    grid = parse_grid(
        [
            "pretrain.lr=0.005,0.01,0.02",
            "midtrain.lr=[0.001, 0.002]",
            "dispatch.scheme=ragged,waterfilling",
            "pretrain.mixture={code: 0.5, prose: 0.5},{code: 0.7, prose: 0.3}",
            "seed=7",
        ]
    )
    assert grid == {
        "pretrain.lr": [0.005, 0.01, 0.02],
        "midtrain.lr": [0.001, 0.002],
        "dispatch.scheme": ["ragged", "waterfilling"],
        "pretrain.mixture": [{"code": 0.5, "prose": 0.5}, {"code": 0.7, "prose": 0.3}],
        "seed": [7],
    }
    for items, message in (
        (["pretrain.lr"], "--grid 'pretrain.lr': expected KEY=V1,V2,..."),
        (["pretrain.lr="], "--grid 'pretrain.lr=': expected KEY=V1,V2,..."),
        (["pretrain.lr=[0.01,"], "--grid pretrain.lr: cannot read the values '[0.01,'"),
        (["pretrain.lr=[]"], "--grid pretrain.lr: give the values to try"),
        (["pretrain.lr=0.01", "pretrain.lr=0.02"], "--grid pretrain.lr is given twice"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_grid(items)


def test_a_learning_rate_written_1e_4_is_a_number_in_a_set_a_grid_a_sample_and_a_recipe(tmp_path: Path) -> None:
    """PyYAML read `1e-4` as text: `--set pretrain.lr=1e-4` was refused as "expected number, got str"."""
    from orchestrator.recipes import Sampling, parse_grid, parse_samples, parse_sets

    assert parse_sets(["pretrain.lr=1e-4", "seed=1E1"]) == {"pretrain.lr": 0.0001, "seed": 10.0}
    assert (
        resolve("marin-535b-a23b", "tiny", sets={"pretrain.lr": 1e-4}).stage_configs["pretrain"]["train"]["lr"] == 1e-4
    )
    assert parse_grid(["pretrain.lr=1e-4,3e-4"]) == {"pretrain.lr": [0.0001, 0.0003]}
    drawn = Sampling(parse_samples(["pretrain.lr=loguniform(1e-4, 1e-2)"]), 3).points()
    assert all(1e-4 <= p["pretrain.lr"] <= 1e-2 for p in drawn), drawn
    data = yaml.safe_load((RECIPES_DIR / "marin-535b-a23b.yaml").read_text())
    data["pretrain"]["lr"] = "LR"
    copy = tmp_path / "sci.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False).replace("LR", "3e-3"))
    assert "lr: 3e-3" in copy.read_text() and load_recipe(copy).data["pretrain"]["lr"] == 0.003


def test_sampled_values_are_different_draws_repeatable_by_seed_and_crossed_with_the_grid() -> None:
    """`--sample KEY=DIST --count N`: N different points, the same for the same seed (a sweep drawn
    again reuses its runs), each within its distribution, floats at 4 significant digits; every
    grid combination runs the same draws, so grid values are compared on the same points."""
    import math

    from orchestrator.recipes import MAX_TRIALS, Sampling, parse_samples, sweep_trials

    samplers = parse_samples(
        ["pretrain.lr=loguniform(0.001, 0.1)", "seed=int(0, 9)", "dispatch.scheme=choice(ragged,waterfilling)"]
    )
    assert [s.text for s in samplers.values()] == [
        "loguniform(0.001, 0.1)",
        "int(0, 9)",
        "choice(ragged, waterfilling)",
    ]
    sampling = Sampling(samplers, 12, seed=3)
    points = sampling.points()
    assert points == Sampling(samplers, 12, seed=3).points() != Sampling(samplers, 12, seed=4).points()
    assert len({json.dumps(p, sort_keys=True) for p in points}) == 12
    for p in points:
        assert 0.001 <= p["pretrain.lr"] <= 0.1 and float(f"{p['pretrain.lr']:.4g}") == p["pretrain.lr"]
        assert p["seed"] in range(10) and isinstance(p["seed"], int)
        assert p["dispatch.scheme"] in ("ragged", "waterfilling")
    # loguniform spreads over orders of magnitude: about half the draws below the geometric middle
    lrs = [p["pretrain.lr"] for p in Sampling({"pretrain.lr": samplers["pretrain.lr"]}, 60, seed=0).points()]
    assert 18 <= sum(lr < math.sqrt(0.001 * 0.1) for lr in lrs) <= 42, lrs
    assert sampling.to_dict() == {
        "samples": {
            "pretrain.lr": "loguniform(0.001, 0.1)",
            "seed": "int(0, 9)",
            "dispatch.scheme": "choice(ragged, waterfilling)",
        },
        "count": 12,
        "seed": 3,
    }

    two = Sampling(parse_samples(["pretrain.lr=uniform(0.01, 0.02)"]), 2)
    trials = sweep_trials({"midtrain.lr": [0.001, 0.002]}, {"seed": 1}, two)
    drawn = [t["pretrain.lr"] for t in trials]
    assert [t["midtrain.lr"] for t in trials] == [0.001, 0.001, 0.002, 0.002]
    assert drawn[:2] == drawn[2:] == [p["pretrain.lr"] for p in two.points()] and all(t["seed"] == 1 for t in trials)
    assert len(sweep_trials({}, None, two)) == 2  # samples alone

    for items, count, message in (
        (["pretrain.lr"], 2, "--sample 'pretrain.lr': expected KEY=DIST"),
        (["pretrain.lr=normal(0,1)"], 2, "--sample pretrain.lr: did you mean 'uniform'? distributions: uniform,"),
        (["pretrain.lr=uniform(0.1)"], 2, "--sample pretrain.lr: uniform() takes two numbers"),
        (["pretrain.lr=uniform(0.2,0.1)"], 2, "uniform(0.2, 0.1): the lowest must be below the highest"),
        (["pretrain.lr=loguniform(0,1)"], 2, "loguniform(0, 1): both ends must be above 0"),
        (["seed=int(0,1.5)"], 2, "--sample seed: int() takes two whole numbers"),
        (["seed=choice()"], 1, "--sample seed: choice() needs the values to choose from"),
        (["seed=uniform"], 1, "--sample seed: cannot read 'uniform' as a distribution"),
        (["seed=int(0,1)", "seed=int(0,2)"], 1, "--sample seed is given twice"),
        (["seed=int(0,1)"], 3, "--count 3 different draws asked, but the distributions gave only 2"),
        (["seed=int(0,99)"], MAX_TRIALS + 1, f"--count {MAX_TRIALS + 1}: more than {MAX_TRIALS} runs"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            Sampling(parse_samples(items), count).points()
    with pytest.raises(ConfigError, match="sweep: pretrain.lr is both sampled and swept"):
        sweep_trials({"pretrain.lr": [0.1]}, None, two)
    with pytest.raises(ConfigError, match="sweep: pretrain.lr is both sampled and set for every run"):
        sweep_trials({}, {"pretrain.lr": 0.1}, two)
    with pytest.raises(ConfigError, match=re.escape("sweep: 66 runs (the product of the grid's lists and --count)")):
        sweep_trials({"seed": list(range(33))}, None, two)


def test_what_changed_is_told_against_the_closest_completed_run_not_only_the_latest(tmp_path: Path) -> None:
    """A local plan after a Docker run: "changed since" the Docker run listed its image and packages
    beside the one value a person changed; against the closest completed run it names that value."""
    import datetime as dt

    from orchestrator.identity import StageIdentity, compute_identity, diff_identities
    from orchestrator.lineage import LineageStore, PipelineRun
    from orchestrator.lineage.models import StageRun
    from orchestrator.pipeline.reuse import closest_completed

    def identity(lr: float, environment: dict, tokens: str = "t" * 64) -> StageIdentity:
        return compute_identity("pretrain", {"lr": lr}, inputs={"tokens": tokens}, environment=environment)

    local = identity(0.01, {"python_version": "3.11.7", "pkg:torch": "2.13.0"})
    docker = identity(0.01, {"image": "sha256:" + "a" * 64})
    now = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    with LineageStore(f"sqlite:///{tmp_path / 'l.db'}") as store:
        runs = {}
        for name, ident, hours in (("local", local, 2), ("docker", docker, 1)):  # the Docker run is the latest
            with store.transaction() as tx:
                run = tx.add(PipelineRun(recipe="r", replica="tiny", state="COMPLETED"))
                runs[name] = tx.add(
                    StageRun(
                        pipeline_run_id=run.id,
                        stage="pretrain",
                        identity=ident.digest,
                        identity_fields=ident.fields(),
                        state="COMPLETED",
                        ended_at=now - dt.timedelta(hours=hours),
                    )
                )
        wanted = identity(0.02, {"python_version": "3.11.7", "pkg:torch": "2.13.0"}).fields()
        found = closest_completed(store, "pretrain", wanted, recipe="r", replica="tiny")
        assert found is not None and found.id == runs["local"].id
        assert [c.path for c in diff_identities(found.identity_fields, wanted)] == ["config.lr"]
        # equally close: the latest
        in_docker = identity(0.02, {"image": "sha256:" + "a" * 64}).fields()
        assert closest_completed(store, "pretrain", in_docker, recipe="r", replica="tiny").id == runs["docker"].id
        # an input not known yet (its stage runs first) does not count against either
        other_tokens = identity(0.02, {"python_version": "3.11.7", "pkg:torch": "2.13.0"}, tokens="u" * 64).fields()
        del other_tokens["inputs"]["tokens"]
        found = closest_completed(
            store, "pretrain", other_tokens, recipe="r", replica="tiny", unknown_inputs=["tokens"]
        )
        assert found is not None and found.id == runs["local"].id
        assert closest_completed(store, "pretrain", wanted, recipe="other", replica="tiny") is not None  # any recipe
        assert closest_completed(store, "eval", wanted) is None
