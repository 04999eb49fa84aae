"""Stage `data`: a real, deterministic text corpus from files every machine has.

Domain sources (config `data.domains: {name: source}`):
  stdlib:code        the Python standard library's *.py files (site-packages excluded), one document each
  stdlib:docstrings  module/class/function docstrings of those files (prose), one document per file
  licenses           /usr/share/common-licenses/* and /usr/share/doc/*/copyright
  path:GLOB          any text files matching GLOB (recursive `**` allowed), one document each
The held-out split is decided per source file by a seeded hash, so a file's code and its docstrings
land in the same split (no leakage between the code and prose held-out sets). A `path:` file is hashed by
its path below the glob's fixed folder, so a moved corpus splits the same way; when the hash leaves a
small domain's split empty, the document nearest the threshold moves across. Files are visited in a
seeded order and taken until `max_bytes_per_domain`, so the corpus is a deterministic function of
(machine's files, seed, caps). The SFT set pairs a function's signature with its docstring.

Output: corpus/<domain>/{train,heldout}.jsonl, sft/{train,heldout}.jsonl, manifest.json, metrics.json.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import inspect
import json
import os
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from .config import Config, WorkloadError
from .util import atomic_write_text, config_fingerprint

SPLITS = ("train", "heldout")


@functools.lru_cache(maxsize=1)
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files)


def _license_files() -> list[Path]:
    files = [p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file()]
    files += [p for p in Path("/usr/share/doc").glob("*/copyright") if p.is_file()]
    return sorted(files)


def _read(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


# Regexes instead of `ast`: parsing every stdlib file costs ~25 ms each (tens of seconds for a tiny
# corpus on 2 cores); a docstring is a triple-quoted string at the start of a file or right after a
# `def ...:`/`class ...:` line, which these patterns find in a few milliseconds per file.
_DOC_RE = re.compile(r'(?:\A|:[ \t]*(?:#[^\n]*)?\n)[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.DOTALL)
_DEF_RE = re.compile(
    r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(((?:[^()]|\([^()]*\))*)\)[ \t]*(?:->[^:\n]*)?:[ \t]*\n"
    r'[ \t]*[rRuU]?("""|\'\'\')(.*?)\3',
    re.DOTALL | re.MULTILINE,
)


def _docstrings(source: str) -> list[str]:
    return [d for d in (inspect.cleandoc(m.group(2)) for m in _DOC_RE.finditer(source)) if d]


def _sft_pairs(source: str, min_chars: int) -> list[dict[str, str]]:
    """(signature, docstring) pairs: the post-training format's raw material."""
    out = []
    for m in _DEF_RE.finditer(source):
        name, args, doc = m.group(1), " ".join(m.group(2).split()), inspect.cleandoc(m.group(4))
        if len(doc) >= min_chars // 2 and len(args) < 300:
            out.append(
                {"prompt": f"### Function:\ndef {name}({args})\n### Docstring:\n", "response": doc.strip() + "\n"}
            )
    return out


def _split_score(key: str, seed: int) -> int:
    """A document's seeded place in [0, 1e6): below ``heldout_fraction * 1e6`` it is held out."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") % 1_000_000


def _split_of(key: str, seed: int, heldout_fraction: float) -> str:
    return "heldout" if _split_score(key, seed) < heldout_fraction * 1_000_000 else "train"


def _glob_root(pattern: str) -> Path:
    """The folder a ``path:`` glob is anchored at (its leading parts without wildcards).

    A file's split is decided by its path *below* this folder, so a corpus that is moved or
    copied elsewhere (another checkout, a cluster's scratch) splits the same way.
    """
    fixed = []
    for part in Path(pattern).parts:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _path_key(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def _source_docs(source: str, files_cache: dict[str, list[Path]], min_chars: int) -> Iterator[tuple[str, str, str]]:
    """Yield (split key, source label, text) documents of one domain source, in the seeded file order."""
    if source == "stdlib:code":
        for p in files_cache["stdlib"]:
            t = _read(p)
            if t and len(t) >= min_chars:
                key = str(p.relative_to(stdlib_dir()))
                yield key, key, t
    elif source == "stdlib:docstrings":
        for p in files_cache["stdlib"]:
            text = "\n\n".join(_docstrings(_read(p) or ""))
            if len(text) >= min_chars:
                key = str(p.relative_to(stdlib_dir()))
                yield key, key, text
    elif source == "licenses":
        for p in files_cache["licenses"]:
            t = _read(p)
            if t and len(t) >= min_chars:
                yield str(p), str(p), t
    elif source.startswith("path:"):
        root = _glob_root(source[5:])
        for p in files_cache[source]:
            t = _read(p)
            if t and len(t) >= min_chars:
                yield _path_key(p, root), str(p), t
    else:
        raise WorkloadError(
            f"data.domains: unknown source '{source}' (stdlib:code, stdlib:docstrings, licenses, path:GLOB)"
        )


def run_data(cfg: Config, out: Path) -> dict[str, object]:
    dc = cfg.data
    fp = config_fingerprint({"data": cfg.to_dict()["data"], "seed": cfg.seed})
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if m.get("fingerprint") == fp:
            return json.loads((out / "metrics.json").read_text())  # already complete: resume = no-op
    if len(dc.domains) < 1:
        raise WorkloadError("data.domains must name at least one domain")
    files_cache: dict[str, list[Path]] = {}
    for src in sorted(set(dc.domains.values())):
        if src.startswith("stdlib:"):
            files = _stdlib_files()
            key = "stdlib"
        elif src == "licenses":
            files, key = _license_files(), "licenses"
        elif src.startswith("path:"):
            files = sorted(Path(p) for p in glob.glob(src[5:], recursive=True) if Path(p).is_file())
            key = src
        else:
            raise WorkloadError(
                f"data.domains: unknown source '{src}' (stdlib:code, stdlib:docstrings, licenses, path:GLOB)"
            )
        if not files:
            raise WorkloadError(f"data.domains: source '{src}' matched no files")
        if key not in files_cache:
            rng_local = random.Random(f"{cfg.seed}:{key}")
            rng_local.shuffle(files)
            files_cache[key] = files

    cap = dc.max_bytes_per_domain
    caps = {"heldout": max(1, int(cap * dc.heldout_fraction)), "train": cap - int(cap * dc.heldout_fraction)}
    manifest: dict[str, object] = {"fingerprint": fp, "seed": cfg.seed, "domains": {}, "sft": {}}
    for name, src in sorted(dc.domains.items()):
        d = out / "corpus" / name
        d.mkdir(parents=True, exist_ok=True)
        buf: dict[str, list[str]] = {s: [] for s in SPLITS}
        size = {s: 0 for s in SPLITS}
        # Per split, the document nearest the other split's side of the threshold: moved across when
        # the hash left the other split empty (a small corpus: 40 files at 5% hold out none about one
        # time in eight), so the split stays a deterministic function of the files and the seed.
        edge: dict[str, tuple[int, int, str, str]] = {}  # split -> (distance, index in buf, label, text)
        threshold = dc.heldout_fraction * 1_000_000
        for key, label, text in _source_docs(src, files_cache, dc.min_doc_chars):
            score = _split_score(key, cfg.seed)
            split = "heldout" if score < threshold else "train"
            if size[split] >= caps[split]:
                if all(size[s] >= caps[s] for s in SPLITS):
                    break
                continue
            distance = abs(score - threshold)
            if split not in edge or distance < edge[split][0]:
                edge[split] = (distance, len(buf[split]), label, text)
            text = text[: caps[split] - size[split] + 1]
            buf[split].append(json.dumps({"text": text, "source": label}))
            size[split] += len(text.encode())
        for empty, full in (("heldout", "train"), ("train", "heldout")):
            if not buf[empty] and len(buf[full]) >= 2:
                _, index, label, text = edge[full]
                size[full] -= len(json.loads(buf[full].pop(index))["text"].encode())
                text = text[: caps[empty] + 1]
                buf[empty].append(json.dumps({"text": text, "source": label}))
                size[empty] += len(text.encode())
        for s in SPLITS:
            if not buf[s]:
                docs = sum(len(b) for b in buf.values())
                raise WorkloadError(
                    f"data: domain '{name}' ({src}) has {docs} document(s) of at least {dc.min_doc_chars} "
                    "characters; it needs at least 2 (one is held out): add files or lower data.min_doc_chars"
                )
            atomic_write_text(d / f"{s}.jsonl", "\n".join(buf[s]) + "\n")
        manifest["domains"][name] = {  # type: ignore[index]
            "source": src,
            **{s: {"docs": len(buf[s]), "bytes": size[s]} for s in SPLITS},
        }

    # Post-training pairs from stdlib functions (always available, whatever the domains are).
    sft: dict[str, list[str]] = {s: [] for s in SPLITS}
    files = files_cache.get("stdlib") or _stdlib_files()
    limit = {"train": dc.max_sft_examples, "heldout": max(1, int(dc.max_sft_examples * dc.heldout_fraction))}
    for p in files:
        if all(len(sft[s]) >= limit[s] for s in SPLITS):
            break
        key = str(p.relative_to(stdlib_dir()))
        split = _split_of(key, cfg.seed, dc.heldout_fraction)
        if len(sft[split]) >= limit[split]:
            continue
        for pair in _sft_pairs(_read(p) or "", dc.min_doc_chars):
            if len(sft[split]) < limit[split]:
                sft[split].append(json.dumps(pair))
    (out / "sft").mkdir(parents=True, exist_ok=True)
    for s in SPLITS:
        atomic_write_text(out / "sft" / f"{s}.jsonl", "\n".join(sft[s]) + "\n")
        manifest["sft"][s] = {"examples": len(sft[s])}  # type: ignore[index]
    metrics = {
        f"data/{n}/{s}_bytes": v[s]["bytes"]
        for n, v in manifest["domains"].items()
        for s in SPLITS  # type: ignore[union-attr]
    }
    metrics.update({f"data/sft/{s}_examples": len(sft[s]) for s in SPLITS})
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2))  # written last: marks completion
    return metrics


def read_jsonl(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
