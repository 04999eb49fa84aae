"""Stage `tokenize`: train a byte-level BPE on the training split and write token shards.

Byte-level BPE never meets an unknown character, so any corpus a user points `data` at tokenizes.
Every document ends with <|endoftext|>. Shards are flat numpy memmaps (uint16 when the vocabulary
fits, else uint32), one per (domain, split), plus the SFT set as ids + a loss mask (1 on response
tokens). manifest.json (written last) lists dtype/length of every shard and marks completion.

Output: tokenizer.json, shards/<domain>/<split>.bin, sft/<split>.{ids,mask}.bin, manifest.json, metrics.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .config import Config, WorkloadError
from .data import SPLITS, read_jsonl
from .util import atomic_write_bytes, atomic_write_text, config_fingerprint

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def _write_shard(path: Path, ids: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    mm = np.memmap(tmp, dtype=ids.dtype, mode="w+", shape=ids.shape)
    mm[:] = ids
    mm.flush()
    del mm
    tmp.replace(path)


def run_tokenize(cfg: Config, out: Path) -> dict[str, object]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = Path(cfg.inputs.corpus or "")
    cm_path = corpus / "manifest.json"
    if not cm_path.is_file():
        raise WorkloadError(f"inputs.corpus: {corpus} has no manifest.json (run the data stage first)")
    cm = json.loads(cm_path.read_text())
    fp = config_fingerprint({"tok": cfg.to_dict()["tokenizer"], "corpus": cm.get("fingerprint")})
    if (out / "manifest.json").is_file() and json.loads((out / "manifest.json").read_text()).get("fingerprint") == fp:
        return json.loads((out / "metrics.json").read_text())

    domains = sorted(cm["domains"])
    docs = {
        (d, s): [r["text"] for r in read_jsonl(corpus / "corpus" / d / f"{s}.jsonl")] for d in domains for s in SPLITS
    }

    def train_iter() -> Iterator[str]:
        for d in domains:
            yield from docs[(d, "train")]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.tokenizer.vocab_size,
        min_frequency=cfg.tokenizer.min_frequency,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_iter(), trainer=trainer)
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    atomic_write_text(out / "tokenizer.json", tok.to_str())

    manifest: dict[str, object] = {
        "fingerprint": fp,
        "vocab_size": vocab,
        "eos_id": eos,
        "pad_id": tok.token_to_id(PAD),
        "dtype": np.dtype(dtype).name,
        "shards": {},
        "sft": {},
    }
    metrics: dict[str, object] = {"tokenize/vocab_size": vocab}
    for (d, s), texts in docs.items():
        enc = tok.encode_batch(texts)
        ids = np.fromiter((i for e in enc for i in (*e.ids, eos)), dtype=dtype)
        rel = f"shards/{d}/{s}.bin"
        _write_shard(out / rel, ids)
        manifest["shards"].setdefault(d, {})[s] = {"path": rel, "tokens": int(ids.size)}  # type: ignore[union-attr]
        metrics[f"tokenize/{d}/{s}_tokens"] = int(ids.size)
        nbytes = sum(len(t.encode()) for t in texts)
        metrics[f"tokenize/{d}/{s}_bytes_per_token"] = nbytes / max(1, ids.size)

    for s in SPLITS:
        pairs = read_jsonl(corpus / "sft" / f"{s}.jsonl")
        if not pairs:
            raise WorkloadError(f"inputs.corpus: sft/{s}.jsonl is empty")
        pe = tok.encode_batch([p["prompt"] for p in pairs])
        re = tok.encode_batch([p["response"] for p in pairs])
        ids_l: list[int] = []
        mask_l: list[int] = []
        for a, b in zip(pe, re, strict=True):
            ids_l += a.ids + b.ids + [eos]
            mask_l += [0] * len(a.ids) + [1] * (len(b.ids) + 1)
        _write_shard(out / f"sft/{s}.ids.bin", np.asarray(ids_l, dtype=dtype))
        _write_shard(out / f"sft/{s}.mask.bin", np.asarray(mask_l, dtype=np.uint8))
        manifest["sft"][s] = {"ids": f"sft/{s}.ids.bin", "mask": f"sft/{s}.mask.bin", "tokens": len(ids_l)}  # type: ignore[index]
        metrics[f"tokenize/sft/{s}_tokens"] = len(ids_l)
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
    atomic_write_bytes(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    return metrics


def load_manifest(tokens_dir: Path) -> dict[str, object]:
    p = tokens_dir / "manifest.json"
    if not p.is_file():
        raise WorkloadError(f"inputs.tokens: {tokens_dir} has no manifest.json (run the tokenize stage first)")
    return json.loads(p.read_text())


def open_shard(tokens_dir: Path, rel: str, dtype: str) -> np.ndarray:
    return np.memmap(tokens_dir / rel, dtype=np.dtype(dtype), mode="r")
