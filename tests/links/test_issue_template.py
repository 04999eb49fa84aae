"""The experiment issue form (.github/ISSUE_TEMPLATE/experiment.yml): a shape GitHub accepts, and
examples that openlab itself reads (the pre-registration parses as a recipe's, the command runs a
recipe and replica that exist and links the issue)."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.preregistration import Prediction
from orchestrator.recipes import find_recipe, load_recipe, parse_recipe, resolve

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / ".github" / "ISSUE_TEMPLATE" / "experiment.yml"

#: GitHub's issue-form schema: the top-level keys it permits, the element types and their keys.
TOP_KEYS = {"name", "description", "title", "labels", "assignees", "projects", "type", "body"}
TYPES = {"markdown", "textarea", "input", "dropdown", "checkboxes"}
ELEMENT_KEYS = {"type", "id", "attributes", "validations"}
ATTRIBUTES = {
    "markdown": {"value"},
    "textarea": {"label", "description", "placeholder", "value", "render"},
    "input": {"label", "description", "placeholder", "value"},
    "dropdown": {"label", "description", "multiple", "options", "default"},
    "checkboxes": {"label", "description", "options"},
}
ID = re.compile(r"^[A-Za-z0-9_-]+$")


def form_problems(form: Any) -> list[str]:
    """What GitHub would refuse in an issue form (the rules of its form schema this form can break)."""
    if not isinstance(form, dict):
        return ["the top level is not a mapping"]
    problems = [f"unknown top-level key {k!r}" for k in sorted(set(form) - TOP_KEYS)]
    for key in ("name", "description"):
        if not (isinstance(form.get(key), str) and form[key].strip()):
            problems.append(f"{key} must be a non-empty string")
    body = form.get("body")
    if not (isinstance(body, list) and body):
        return [*problems, "body must be a non-empty list"]
    ids: list[str] = []
    labels: list[str] = []
    for i, item in enumerate(body):
        where = f"body[{i}]"
        if not isinstance(item, dict) or item.get("type") not in TYPES:
            problems.append(f"{where}: type must be one of {sorted(TYPES)}")
            continue
        kind = item["type"]
        problems += [f"{where}: key {k!r} not permitted" for k in sorted(set(item) - ELEMENT_KEYS)]
        attrs = item.get("attributes")
        if not isinstance(attrs, dict):
            problems.append(f"{where}: attributes must be a mapping")
            continue
        problems += [f"{where}: attribute {k!r} not permitted" for k in sorted(set(attrs) - ATTRIBUTES[kind])]
        if kind == "markdown":
            if "id" in item or "validations" in item:
                problems.append(f"{where}: markdown takes neither id nor validations")
            if not (isinstance(attrs.get("value"), str) and attrs["value"].strip()):
                problems.append(f"{where}: markdown needs attributes.value")
            continue
        if not (isinstance(item.get("id"), str) and ID.match(item["id"])):
            problems.append(f"{where}: id must be letters, digits, - and _")
        else:
            ids.append(item["id"])
        if not (isinstance(attrs.get("label"), str) and attrs["label"].strip()):
            problems.append(f"{where}: attributes.label must be a non-empty string")
        else:
            labels.append(attrs["label"])
        required = (item.get("validations") or {}).get("required", False)
        if not isinstance(required, bool):
            problems.append(f"{where}: validations.required must be true or false")
    problems += [f"id {x!r} is used twice" for x in sorted({x for x in ids if ids.count(x) > 1})]
    problems += [f"label {x!r} is used twice" for x in sorted({x for x in labels if labels.count(x) > 1})]
    if not ids:
        problems.append("the form has no field people can fill in")
    return problems


def _form() -> dict[str, Any]:
    return yaml.safe_load(TEMPLATE.read_text(encoding="utf-8"))


def _field(form: dict[str, Any], field_id: str) -> dict[str, Any]:
    [item] = [i for i in form["body"] if i.get("id") == field_id]
    return item["attributes"]


def test_experiment_form_is_a_valid_issue_form() -> None:
    form = _form()
    assert form_problems(form) == []
    ids = [i["id"] for i in form["body"] if "id" in i]
    assert {"hypothesis", "recipe", "replica", "command", "preregistered", "wandb-report", "results"} <= set(ids)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda f: f["body"][2].update(id=f["body"][1]["id"]),
        lambda f: f["body"][1]["attributes"].pop("label"),
        lambda f: f["body"][0].update(id="intro"),
        lambda f: f.pop("description"),
        lambda f: f["body"][1].update(type="text"),
    ],
    ids=["duplicate id", "no label", "markdown with id", "no description", "unknown type"],
)
def test_the_shape_check_catches_what_github_refuses(break_it) -> None:
    form = _form()
    break_it(form)
    assert form_problems(form) != []


def test_the_preregistration_example_parses_as_a_recipe_preregistration() -> None:
    """The example is written in the recipe's own format: put into the tiny replica, the recipe parser
    reads it into the prediction a run would record and check."""
    example = yaml.safe_load(_field(_form(), "preregistered")["placeholder"])
    recipe = load_recipe("marin-535b-a23b", root=REPO_ROOT)
    data = copy.deepcopy(recipe.data)
    data["replicas"]["tiny"]["preregistered"] = example["preregistered"]
    resolved = resolve(parse_recipe(data, recipe.path), "tiny", validate=False)
    assert resolved.preregistered == (Prediction("eval/code/loss", "eval", 5.3, 0.4, "from the scaling law fit"),)


def test_the_command_example_runs_a_recipe_and_replica_that_exist_and_links_the_issue() -> None:
    form = _form()
    args = shlex.split(_field(form, "command")["placeholder"])
    assert args[:2] == ["openlab", "run"] and "--issue" in args
    recipe = load_recipe(find_recipe(args[2], root=REPO_ROOT))
    assert args[args.index("--replica") + 1] in recipe.replicas
    assert _field(form, "recipe")["placeholder"] == args[2]
    assert _field(form, "replica")["placeholder"] in recipe.replicas
