"""Pack tokenised documents into fixed-length sequences, and read them back with random access.

Steps (all seeded):
  1. optional repo-level documents: the files of one repository (metadata "repo", path from
     metadata "path" or the id) concatenated as `<|repo_name|>repo\\n<|file_sep|>path\\ntext...`;
  2. documents are split into train / validation (`val_fraction`, per document, before
     up-sampling so no copy of a validation document lands in train);
  3. optional fill-in-the-middle on code documents (source in `code_sources` or an id ending
     in .py), at rate `fim_rate`, PSM or SPM (`spm_rate` of the FIM ones), StarCoder layout:
     PSM `<|fim_prefix|>pre<|fim_suffix|>suf<|fim_middle|>mid`,
     SPM `<|fim_prefix|><|fim_suffix|>suf<|fim_middle|>pre mid`;
  4. train documents are repeated by their quality weight (metadata quality.weight: floor(w)
     copies plus one more with probability frac(w));
  5. document order is shuffled; each document is followed by <|endoftext|>; the stream is cut
     into seq_len windows (the last one padded with <|pad|>, counted in meta "pad_tokens").

On disk, per split, shards `{split}/{k:05d}/` of up to `sequences_per_shard` sequences:
  tokens.bin       uint32, sequence i at bytes [i*seq_len*4, (i+1)*seq_len*4)
  doc_starts.bin   uint32, offsets inside the sequence where a document (or its continuation
                   at offset 0) starts, for all sequences back to back
  index.npy        int64[n+1]: sequence i's starts are doc_starts[index[i]:index[i+1]]
  meta.json        {"sequences": n}
  loss_mask.bin    optional (pack_samples, SFT): uint8, one per token like tokens.bin; 1 = the
                   token is a training target. Present only when the top-level meta says
                   "loss_mask": true; datasets without it read exactly as before.
plus a top-level meta.json (seq_len, splits and their shards, special ids, counts). Every read
is a byte range, so PackedDataset works on a local directory or through a Store (S3).
"""
from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from pydantic import Field, model_validator

from data_processing.common import StepConfig, iter_input_documents
from data_processing.document import Document, shard_paths
from data_processing.tokenizer import EOS, PAD, TOKENIZER_FILE, load_tokenizer
from runtime.stage import Workdir

META = "meta.json"


class PackConfig(StepConfig):
    seq_len: int = Field(default=512, ge=8, description="tokens per packed sequence")
    val_fraction: float = Field(default=0.02, ge=0.0, lt=1.0, description=(
        "share of documents (seeded, before up-sampling) that go to the validation split"))
    upsample: bool = Field(True, description=(
        "repeat train documents by their quality weight (floor(w) copies plus one with probability frac(w))"))
    repo_level: bool = Field(False, description=(
        "concatenate the files of one repository (metadata repo) into one document"))
    fim_rate: float = Field(default=0.0, ge=0.0, le=1.0, description=(
        "share of code documents turned into fill-in-the-middle examples"))
    spm_rate: float = Field(default=0.5, ge=0.0, le=1.0, description=(
        "share of the fill-in-the-middle examples in SPM layout (the rest PSM)"))
    code_sources: tuple[str, ...] = Field(("code", "stdlib", "issue-pr"), description=(
        "document sources that are code (for fill-in-the-middle; ids ending in .py are code too)"))
    sequences_per_shard: int = Field(default=8192, ge=1, description="sequences per on-disk shard")
    seed: int = Field(0, description="seed of the split, up-sampling, fill-in-the-middle and shuffle")

    @model_validator(mode="after")
    def _check(self) -> "PackConfig":
        if self.fim_rate > 0 and not self.code_sources:
            raise ValueError("fim_rate > 0 needs code_sources naming which documents are code")
        return self


# ---------------------------------------------------------------------------------------------
# Document transforms
def repo_documents(docs: list[Document]) -> list[Document]:
    """Merge documents that carry metadata['repo'] into one document per repository."""
    repos: dict[str, list[Document]] = {}
    out: list[Document] = []
    for d in docs:
        repo = d.metadata.get("repo")
        if isinstance(repo, str) and repo:
            repos.setdefault(repo, []).append(d)
        else:
            out.append(d)
    for repo, files in repos.items():
        files.sort(key=lambda d: str(d.metadata.get("path") or d.id))
        text = f"<|repo_name|>{repo}\n" + "".join(f"<|file_sep|>{d.metadata.get('path') or d.id}\n{d.text}" for d in files)
        weight = max(float((d.metadata.get("quality") or {}).get("weight", 1.0)) for d in files)
        out.append(Document(f"repo:{repo}", text, files[0].source, {"repo": repo, "files": len(files), "quality": {"weight": weight}}))
    return out


def fim_transform(text: str, rng: random.Random, spm_rate: float) -> str:
    """Split at two random character positions; PSM or SPM layout (StarCoder's)."""
    if len(text) < 3:
        return text
    a, b = sorted(rng.sample(range(len(text) + 1), 2))
    pre, mid, suf = text[:a], text[a:b], text[b:]
    if rng.random() < spm_rate:
        return f"<|fim_prefix|><|fim_suffix|>{suf}<|fim_middle|>{pre}{mid}"
    return f"<|fim_prefix|>{pre}<|fim_suffix|>{suf}<|fim_middle|>{mid}"


def is_code(doc: Document, code_sources: tuple[str, ...]) -> bool:
    return doc.source in code_sources or doc.id.endswith(".py")


def copies(weight: float, rng: random.Random) -> int:
    base = math.floor(weight)
    return base + (1 if rng.random() < weight - base else 0)


# ---------------------------------------------------------------------------------------------
# Writing
# Document metadata flag: never split this document across sequences when it fits in one (a
# retrieval prompt whose needle would otherwise land in another sequence than its question).
WHOLE = "pack_whole"


class _SplitWriter:
    def __init__(self, root: Path, split: str, seq_len: int, per_shard: int, pad_id: int,
                 loss_mask: bool = False):
        self.root, self.split, self.seq_len, self.per_shard, self.pad_id = root, split, seq_len, per_shard, pad_id
        self.loss_mask = loss_mask
        self.buf: list[int] = []
        self.mbuf: list[int] = []   # loss mask of buf (loss_mask=True only)
        self.masks: list[np.ndarray] = []
        self.starts: list[int] = []  # starts inside the current (unfinished) sequence
        self.seqs: list[np.ndarray] = []
        self.seq_starts: list[list[int]] = []
        self.shards: list[dict] = []
        self.total = 0
        self.pad_tokens = 0

    def add(self, ids: list[int], mask: list[int] | None = None) -> None:
        if (mask is not None) != self.loss_mask:
            raise ValueError("a loss mask is given exactly when the writer stores one")
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"loss mask has {len(mask)} entries for {len(ids)} tokens")
        pos = 0
        while pos < len(ids):
            if len(self.buf) == 0 or pos == 0:
                self.starts.append(len(self.buf))
            take = min(self.seq_len - len(self.buf), len(ids) - pos)
            self.buf.extend(ids[pos : pos + take])
            if mask is not None:
                self.mbuf.extend(mask[pos : pos + take])
            pos += take
            if len(self.buf) == self.seq_len:
                self._emit()

    def _emit(self) -> None:
        starts = sorted(set(self.starts) | {0})
        self.seqs.append(np.asarray(self.buf, dtype=np.uint32))
        self.seq_starts.append(starts)
        if self.loss_mask:
            self.masks.append(np.asarray(self.mbuf, dtype=np.uint8))
        self.buf, self.starts, self.mbuf = [], [], []
        if len(self.seqs) >= self.per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self.seqs:
            return
        d = self.root / self.split / f"{len(self.shards):05d}"
        d.mkdir(parents=True, exist_ok=True)
        np.stack(self.seqs).tofile(d / "tokens.bin")
        flat = np.asarray([s for st in self.seq_starts for s in st], dtype=np.uint32)
        flat.tofile(d / "doc_starts.bin")
        index = np.zeros(len(self.seqs) + 1, dtype=np.int64)
        index[1:] = np.cumsum([len(st) for st in self.seq_starts])
        np.save(d / "index.npy", index)
        if self.loss_mask:
            np.stack(self.masks).tofile(d / "loss_mask.bin")
        (d / META).write_text(json.dumps({"sequences": len(self.seqs)}))
        self.shards.append({"dir": f"{self.split}/{len(self.shards):05d}", "sequences": len(self.seqs)})
        self.total += len(self.seqs)
        self.seqs, self.seq_starts, self.masks = [], [], []

    def room(self) -> int:
        """Tokens that still fit in the current sequence."""
        return self.seq_len - len(self.buf)

    def pad_sequence(self) -> None:
        """Pad the current partial sequence to seq_len (padding is never a target) and emit it."""
        if self.buf:
            n = self.seq_len - len(self.buf)
            self.pad_tokens += n
            self.buf.extend([self.pad_id] * n)
            self.mbuf.extend([0] * n if self.loss_mask else [])
            self._emit()

    def close(self) -> None:
        self.pad_sequence()  # the last partial sequence
        self._flush()


def pack(docs: list[Document], tok, cfg: PackConfig, out: Path, progress=None) -> dict:
    rng = random.Random(cfg.seed)
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    if cfg.repo_level:
        docs = repo_documents(docs)
    train_docs, val_docs = [], []
    for d in docs:
        (val_docs if rng.random() < cfg.val_fraction else train_docs).append(d)
    if cfg.val_fraction > 0 and not val_docs and len(train_docs) > 1:
        val_docs.append(train_docs.pop())  # always hold something out when asked to
    meta: dict[str, Any] = {"seq_len": cfg.seq_len, "dtype": "uint32", "eos_id": eos, "pad_id": pad, "splits": {}, "seed": cfg.seed}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        order: list[Document] = []
        for d in split_docs:
            n = copies(float((d.metadata.get("quality") or {}).get("weight", 1.0)), rng) if (cfg.upsample and split == "train") else 1
            order.extend([d] * n)
        rng.shuffle(order)
        texts = [fim_transform(d.text, rng, cfg.spm_rate) if cfg.fim_rate and is_code(d, cfg.code_sources) and rng.random() < cfg.fim_rate else d.text for d in order]
        w = _SplitWriter(out, split, cfg.seq_len, cfg.sequences_per_shard, pad)
        n_tokens = 0
        for s in range(0, len(texts), 512):
            for d, enc in zip(order[s : s + 512], tok.encode_batch(texts[s : s + 512])):
                ids = enc.ids + [eos]
                n_tokens += len(ids)
                if d.metadata.get(WHOLE) and w.room() < len(ids) <= cfg.seq_len:
                    w.pad_sequence()    # a document that only makes sense whole starts a new sequence
                w.add(ids)
            if progress:
                progress(min(s + 512, len(texts)), len(texts), f"pack {split}")
        w.close()
        meta["splits"][split] = {
            "sequences": w.total,
            "shards": w.shards,
            "documents": len(split_docs),
            "documents_after_upsampling": len(order),
            "tokens": n_tokens,
            "pad_tokens": w.pad_tokens,
        }
    (out / META).write_text(json.dumps(meta, indent=2))
    return meta


def run(cfg: PackConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    tok_dirs = [p for p in inputs.values() if (Path(p) / TOKENIZER_FILE).exists()]
    doc_dirs = [p for p in inputs.values() if shard_paths(p)]
    if len(tok_dirs) != 1:
        raise ValueError(f"pack: expected exactly one parent holding {TOKENIZER_FILE}, got {len(tok_dirs)}")
    if not doc_dirs:
        raise ValueError("pack: no parent with document shards")
    tok = load_tokenizer(tok_dirs[0])
    (workdir.out / TOKENIZER_FILE).write_bytes((Path(tok_dirs[0]) / TOKENIZER_FILE).read_bytes())
    docs = [d for p in doc_dirs for d in iter_input_documents(p)]
    meta = pack(docs, tok, cfg, workdir.out, workdir.progress)
    return {
        "seq_len": cfg.seq_len,
        "train_sequences": meta["splits"]["train"]["sequences"],
        "val_sequences": meta["splits"]["val"]["sequences"],
        "train_tokens": meta["splits"]["train"]["tokens"],
        "val_tokens": meta["splits"]["val"]["tokens"],
        "documents": len(docs),
        "documents_after_upsampling": meta["splits"]["train"]["documents_after_upsampling"] + meta["splits"]["val"]["documents"],
    }


def _add_whole(w: "_SplitWriter", split: str, samples, seq_len: int) -> tuple[int, int]:
    """Append whole samples (ids, loss mask), a sample that does not fit starting a new sequence;
    -> (tokens, target tokens). A sample longer than seq_len is a ValueError."""
    n_tokens = n_targets = 0
    for i, (ids, mask) in enumerate(samples):
        if len(ids) > seq_len:
            raise ValueError(f"{split} sample {i} has {len(ids)} tokens, more than seq_len={seq_len}")
        if len(ids) > w.room():
            w.pad_sequence()
        w.add(list(ids), list(mask))
        n_tokens += len(ids)
        n_targets += int(sum(mask))
    return n_tokens, n_targets


def pack_samples(splits: dict[str, list[tuple[list[int], list[int]]]], out: Path, seq_len: int, pad_id: int,
                 eos_id: int, sequences_per_shard: int = 8192, extra_meta: dict | None = None) -> dict:
    """Pack whole samples (ids, loss mask) in the given order, never splitting one: a sample that
    does not fit in the current sequence starts a new one (the rest is padding). Every sample
    start is a document start, so attention and positions restart per sample, and the loss mask
    is stored beside the tokens (meta "loss_mask": true). A sample longer than seq_len is a
    ValueError: the caller decides what to drop."""
    meta: dict[str, Any] = {"seq_len": seq_len, "dtype": "uint32", "eos_id": eos_id, "pad_id": pad_id,
                            "loss_mask": True, "splits": {}, **(extra_meta or {})}
    for split, samples in splits.items():
        w = _SplitWriter(out, split, seq_len, sequences_per_shard, pad_id, loss_mask=True)
        n_tokens, n_targets = _add_whole(w, split, samples, seq_len)
        w.close()
        meta["splits"][split] = {"sequences": w.total, "shards": w.shards, "documents": len(samples),
                                 "tokens": n_tokens, "target_tokens": n_targets, "pad_tokens": w.pad_tokens}
    out.mkdir(parents=True, exist_ok=True)
    (out / META).write_text(json.dumps(meta, indent=2))
    return meta


def with_samples(src: Path, out: Path, samples: dict[str, list[tuple[list[int], list[int]]]],
                 sequences_per_shard: int = 8192) -> dict:
    """A copy of the packed dataset at `src` (sequences and document starts unchanged) followed by
    whole `samples` (ids, loss mask) per split, in a dataset with a loss mask: src sequences
    keep theirs, or get all ones (every token a target) when src has none. For mixing synthetic
    token tasks (training.synthetic) into packed text. A sample longer than seq_len is a ValueError."""
    src_meta = json.loads((Path(src) / META).read_text())
    seq_len, pad = int(src_meta["seq_len"]), src_meta["pad_id"]
    unknown = set(samples) - set(src_meta["splits"])
    if unknown:
        raise ValueError(f"samples for splits {sorted(unknown)} that {src} does not have")
    meta: dict[str, Any] = {**src_meta, "loss_mask": True, "splits": {}}
    for split in src_meta["splits"]:
        w = _SplitWriter(out, split, seq_len, sequences_per_shard, pad, loss_mask=True)
        for item in PackedDataset(src, split):
            ids, starts = item["input_ids"].tolist(), [int(s) for s in item["doc_starts"]] + [seq_len]
            mask = item["loss_mask"].tolist() if "loss_mask" in item else [1] * seq_len
            for a, b in zip(starts[:-1], starts[1:]):
                if b > a:
                    w.add(ids[a:b], mask[a:b])
        extra = samples.get(split, [])
        _add_whole(w, split, extra, seq_len)
        w.close()
        meta["splits"][split] = {**src_meta["splits"][split], "sequences": w.total, "shards": w.shards,
                                 "added_samples": len(extra)}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / META).write_text(json.dumps(meta, indent=2))
    return meta


# ---------------------------------------------------------------------------------------------
# Reading
class PackedDataset:
    """Random access to packed sequences.

    location: a local directory (pack's output) or (store, prefix) for a glmforge Store, read
    with byte-range requests (tokens of one sequence = one range read). The same index always
    returns the same sample: the order is fixed on disk when packing.
    """

    def __init__(self, location: Path | str | tuple[Any, str], split: str = "train"):
        if isinstance(location, tuple):
            self.store, prefix = location
            self.prefix = prefix.rstrip("/")
            self.root = None
        else:
            self.store, self.prefix, self.root = None, "", Path(location)
        try:
            self.meta = json.loads(self._read(META))
        except FileNotFoundError as e:
            raise ValueError(f"{self._where(META)}: no packed dataset here (meta.json missing)") from e
        if split not in self.meta["splits"]:
            raise ValueError(f"split {split!r} not in {sorted(self.meta['splits'])}")
        self.split = split
        self.seq_len = int(self.meta["seq_len"])
        self.shards = self.meta["splits"][split]["shards"]
        self.offsets = np.cumsum([0] + [s["sequences"] for s in self.shards])
        self._index: dict[int, np.ndarray] = {}

    def _where(self, rel: str) -> str:
        return f"{self.store.uri}/{self.prefix}/{rel}" if self.store is not None else str(self.root / rel)

    def _read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        if self.store is not None:
            return self.store.get_bytes(f"{self.prefix}/{rel}" if self.prefix else rel, start, end)
        with open(self.root / rel, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(end - (start or 0))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _shard_index(self, k: int) -> np.ndarray:
        if k not in self._index:
            self._index[k] = np.load(io.BytesIO(self._read(f"{self.shards[k]['dir']}/index.npy")))
        return self._index[k]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} sequences")
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = i - int(self.offsets[k])
        d = self.shards[k]["dir"]
        nbytes = self.seq_len * 4
        tokens = np.frombuffer(self._read(f"{d}/tokens.bin", j * nbytes, (j + 1) * nbytes), dtype=np.uint32)
        idx = self._shard_index(k)
        starts = np.frombuffer(self._read(f"{d}/doc_starts.bin", int(idx[j]) * 4, int(idx[j + 1]) * 4), dtype=np.uint32)
        item = {"input_ids": tokens.astype(np.int64), "doc_starts": starts.astype(np.int64)}
        if self.meta.get("loss_mask"):
            mask = np.frombuffer(self._read(f"{d}/loss_mask.bin", j * self.seq_len, (j + 1) * self.seq_len),
                                 dtype=np.uint8)
            item["loss_mask"] = mask.astype(np.int64)
        return item

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(self)):
            yield self[i]
