"""Stage `data` on a user's own corpus (`path:GLOB`): small corpora split reliably and portably."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workloads.moe.config import WorkloadError, parse_config
from workloads.moe.data import run_data


def _corpus(folder: Path, names: list[str]) -> Path:
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        (folder / name).write_text(f"def f{i}(x):\n    return x * {i}  # corpus line {i}\n" * 20)
    return folder


def _split(out: Path, root: Path) -> dict[str, list[str]]:
    """Which files (relative to the corpus folder) each split of domain `code` holds."""
    docs = {}
    for split in ("train", "heldout"):
        lines = (out / "corpus" / "code" / f"{split}.jsonl").read_text().splitlines()
        docs[split] = sorted(str(Path(json.loads(line)["source"]).relative_to(root)) for line in lines)
    return docs


def _cfg(corpus: Path) -> object:
    return parse_config({"data": {"domains": {"code": f"path:{corpus}/*.txt"}, "max_sft_examples": 5}})


def test_a_small_corpus_always_holds_a_document_out_and_splits_the_same_wherever_it_lives(tmp_path: Path) -> None:
    """Three files at a 5% held-out fraction: the hash alone holds none out most of the time, which used to
    fail the stage (or not) depending on the folder's absolute path. Now the file nearest the threshold is
    held out, and a copy of the corpus elsewhere splits exactly the same way."""
    names = ["a.txt", "b.txt", "c.txt"]
    here = _corpus(tmp_path / "here" / "corpus", names)
    run_data(_cfg(here), tmp_path / "out-here")
    split = _split(tmp_path / "out-here", here)
    assert len(split["heldout"]) == 1 and len(split["train"]) == 2, split
    assert sorted(split["heldout"] + split["train"]) == names

    there = tmp_path / "somewhere" / "else" / "corpus"
    shutil.copytree(here, there)
    run_data(_cfg(there), tmp_path / "out-there")
    assert _split(tmp_path / "out-there", there) == split


def test_a_one_file_corpus_is_refused_in_one_line_naming_the_domain(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus", ["only.txt"])
    with pytest.raises(WorkloadError) as err:
        run_data(_cfg(corpus), tmp_path / "out")
    said = str(err.value)
    assert "domain 'code'" in said and "has 1 document(s)" in said and "needs at least 2" in said, said
    assert "\n" not in said
