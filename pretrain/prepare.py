"""`elmo-pretrain prepare`: raw text -> a prepared corpus folder.

    out/
      manifest.json          settings, inputs, what was kept/skipped and why, vocab and shard index
      sentences.train.txt    cleaned, de-duplicated sentences, one a line
      sentences.heldout.txt
      tokenizer.model        sentencepiece only
      vocab.txt              "token<TAB>train count", one a line; line number = token id
      shards/{split}-NNNNN.tokens.npy   int32 [n_tokens], token ids, no sentence markers
      shards/{split}-NNNNN.offsets.npy  int64 [n_sentences + 1], sentence starts in .tokens

Each shard's two files have their sha256 in the manifest; loading a split checks them,
and that ids are in the vocabulary and offsets never decrease (``data.load_shard``).

Token ids are our own, sorted by training frequency so that a log-uniform
sampler and an adaptive softmax see the usual Zipf order: 0 ``<S>``,
1 ``</S>``, 2 ``<unk>``, then tokens by count. For word vocabularies the
softmax covers the first ``softmax_size`` ids; rarer (and held-out only)
words keep an id so the character CNN still reads their spelling, and their
training target is ``<unk>`` (as in bilm-tf).

The folder is built in a temporary sibling and renamed into place, so an
interrupted run leaves nothing half-written under ``out``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field
from tqdm import tqdm

from elmo_pretrain import text as T
from elmo_service.atomic import atomic_dir, sha256_file
from elmo_service.errors import ElmoServiceError, InputError
from elmo_service.settings_base import Cli, StrictModel

FORMAT = "elmo-pretrain-corpus"
FORMAT_VERSION = 1
BOS, EOS, UNK = "<S>", "</S>", "<unk>"
SPECIALS = (BOS, EOS, UNK)
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2


# The character coverage chosen for the script (``coverage_for``; the one rule that
# docs/languages.md, ``prepare --help`` and tests/pretrain/test_prepare.py repeat). Latin
# text keeps sentencepiece's default, as every preparation did before the choice by script
# (the bundled model's recipe, and their params hashes, stay as they were).
RICH_SCRIPT_COVERAGE, LATIN_COVERAGE, ALPHABET_COVERAGE = 0.9995, 0.9995, 1.0


class PrepareOptions(StrictModel):
    """Options of ``elmo-pretrain prepare`` (its flags are derived from these fields).

    A job's ``prepare`` section is the subset :data:`JOB_FIELDS` of them. Every
    option is part of the preparation's identity (``params_hash``).
    """

    error_class: ClassVar[type[ElmoServiceError]] = InputError

    tokenizer: Literal["sentencepiece", "word"] = Field(
        "sentencepiece", description="subword pieces, or whitespace/punctuation words"
    )
    vocab_size: int = Field(
        16000, ge=4, le=2_000_000, description="softmax size incl. <S>, </S>, <unk>"
    )
    sp_model: str | None = Field(
        None,
        description="sentencepiece: encode with this tokenizer.model instead of training one "
        "(a model's own, to adapt it: `elmo-pretrain adapt`)",
    )
    sp_model_type: Literal["unigram", "bpe", "char", "word"] = Field(
        "unigram", description="sentencepiece's model type"
    )
    byte_fallback: bool = Field(
        True, description="sentencepiece: rare characters become byte pieces instead of <unk>"
    )
    character_coverage: float | None = Field(
        None,
        gt=0,
        le=1,
        description="sentencepiece: share of characters kept as pieces (the rest become byte "
        "pieces); default: chosen for the script of the training text: "
        f"{RICH_SCRIPT_COVERAGE} for text mostly in Chinese/Japanese/Korean characters, "
        f"{LATIN_COVERAGE} for Latin text (sentencepiece's default: a rare character such as "
        f"'?' in a small corpus becomes bytes), {ALPHABET_COVERAGE} for another alphabet "
        "(Cyrillic, Greek, ...: every character a piece)",
    )
    sp_input_sentences: int = Field(
        2_000_000, ge=1, description="sentencepiece trains on a sample this large"
    )
    split: Literal["paragraphs", "lines", "none"] = Field(
        "paragraphs",
        description="paragraphs: blank-line separated running text; lines: each line is "
        "running text; none: one sentence a line",
    )
    pretokenized: bool = Field(
        False, description="word tokenizer: split on whitespace only (e.g. PTB)"
    )
    lowercase: bool = Field(False, description="lowercase all text")
    dedupe: bool = Field(
        True, description="drop duplicate sentences (keep them for benchmarks such as PTB)"
    )
    heldout_fraction: float = Field(
        0.01, ge=0, lt=0.5, description="share of sentences held out (by hash, stable)"
    )
    heldout_files: Annotated[list[str], Cli(flag="--heldout", metavar="FILE")] = Field(
        default_factory=list, description="held-out files instead of a random fraction"
    )
    encoding_errors: Literal["replace", "skip"] = Field(
        "replace", description="invalid UTF-8: replace bytes or skip the line"
    )
    max_line_chars: int = Field(
        1_000_000,
        ge=100,
        description="longer lines are skipped and counted (whole speeches on one line are ~200k)",
    )
    max_sentence_words: int = Field(250, ge=1, description="longer sentences are skipped")
    shard_tokens: int = Field(50_000_000, ge=1000, description="tokens per shard file")
    seed: int = Field(1234, description="sentencepiece sampling seed")
    threads: int = Field(2, description="sentencepiece training threads")


# the options `elmo-pretrain prepare` shows as flags (seed and sample size are not)
CLI_FIELDS = tuple(
    n for n in PrepareOptions.model_fields if n not in ("sp_input_sentences", "seed")
)
# the options a pretraining job may set: no paths, nothing about the worker's machine
JOB_FIELDS = (
    "tokenizer",
    "vocab_size",
    "sp_model_type",
    "byte_fallback",
    "character_coverage",
    "split",
    "pretokenized",
    "lowercase",
    "dedupe",
    "heldout_fraction",
    "max_sentence_words",
)


def _inputs_fingerprint(files: list[Path]) -> list[dict[str, Any]]:
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f.resolve()), "bytes": st.st_size, "mtime": int(st.st_mtime)})
    return out


def _params_hash(opts: PrepareOptions, train: list[dict], heldout: list[dict]) -> str:
    # an unset sp_model stays out of the hash: earlier preparations keep theirs
    options = opts.model_dump(exclude={"sp_model"} if opts.sp_model is None else set())
    if options["character_coverage"] is None:  # chosen for the script: hashed as the old
        options["character_coverage"] = LATIN_COVERAGE  # default, so English keeps its hash
    given = {"sp_model_sha256": sha256_file(Path(opts.sp_model))} if opts.sp_model else {}
    blob = json.dumps(
        {"options": options, "train": train, "heldout": heldout, **given},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def check_output(out: Path, params_hash: str, force: bool) -> bool:
    """True if ``out`` already holds this exact preparation (nothing to do)."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise InputError(f"output {out} exists and is not a folder", field="out")
    if not any(out.iterdir()):
        return False
    manifest = out / "manifest.json"
    if manifest.is_file():
        try:
            old = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("params_hash") == params_hash and not force:
            return True
        if not force:
            raise InputError(
                f"output folder {out} already holds a different prepared corpus "
                f"(params hash {old.get('params_hash')}, this run {params_hash}); "
                "pass --force to replace it or choose another folder",
                field="out",
            )
    elif not force:
        raise InputError(
            f"output folder {out} is not empty and is not a prepared corpus; pass --force to replace it",
            field="out",
        )
    return False


class ShardWriter:
    """Appends sentences' token ids; flushes ``.tokens``/``.offsets`` .npy pairs of bounded size."""

    def __init__(self, folder: Path, split: str, shard_tokens: int) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.bufs: list[np.ndarray] = []
        self.lens: list[int] = []
        self.n_buf = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: np.ndarray) -> None:
        self.bufs.append(ids.astype(np.int32, copy=False))
        self.lens.append(len(ids))
        self.n_buf += len(ids)
        if self.n_buf >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.lens:
            return
        name = f"{self.split}-{len(self.shards):05d}"
        tokens = np.concatenate(self.bufs)
        offsets = np.zeros(len(self.lens) + 1, dtype=np.int64)
        np.cumsum(self.lens, out=offsets[1:])
        np.save(self.folder / f"{name}.tokens.npy", tokens)
        np.save(self.folder / f"{name}.offsets.npy", offsets)
        self.shards.append({"name": name, "sentences": len(self.lens), "tokens": int(len(tokens))})
        self.bufs, self.lens, self.n_buf = [], [], 0


def _sentences_from(files: list[Path], opts: PrepareOptions, stats: Counter, bar, log=print) -> Any:
    for f in files:
        lines = T.read_lines(
            f, stats, opts.encoding_errors, opts.max_line_chars, on_bytes=bar.update
        )
        seen = Counter()  # this file's blank and non-blank lines
        lines = _counted(lines, seen)
        for unit in T.units(lines, opts.split, 4 * opts.max_line_chars, stats):
            yield from T.sentences_of(unit, opts.split, opts.lowercase)
        if opts.split == "paragraphs" and seen["text"] > 1 and not seen["blank"]:
            # one sentence (or paragraph) a line, read as a single paragraph of running
            # text: lines without end punctuation run together into long "sentences"
            stats["files_without_blank_lines"] += 1
            log(
                f"warning: {f} has no blank line: with --split paragraphs (the default) its "
                f"{seen['text']} lines are read as running text, one paragraph; if each line "
                "is a sentence pass --split none, if each is a paragraph --split lines"
            )


def _counted(lines, seen: Counter):
    for line in lines:
        seen["text" if line.strip() else "blank"] += 1
        yield line


def prepare(
    inputs: list[str],
    out: str | Path,
    opts: PrepareOptions | None = None,
    *,
    force: bool = False,
    progress: bool = True,
    log=print,
) -> dict[str, Any]:
    """Run the whole preparation; returns the manifest. Raises InputError on bad input."""
    opts = opts or PrepareOptions()  # validated when built
    out = Path(out)
    if not inputs:
        raise InputError("no input files given", field="inputs")
    train_files = T.expand_inputs(inputs)
    if opts.sp_model and not Path(opts.sp_model).is_file():
        raise InputError(f"no sentencepiece model at {opts.sp_model}", field="sp_model")
    heldout_files = T.expand_inputs(opts.heldout_files) if opts.heldout_files else []
    train_fp, heldout_fp = _inputs_fingerprint(train_files), _inputs_fingerprint(heldout_files)
    params_hash = _params_hash(opts, train_fp, heldout_fp)
    if check_output(out, params_hash, force):
        log(f"{out} already holds this preparation (params hash {params_hash}); nothing to do")
        return json.loads((out / "manifest.json").read_text())

    t0 = time.time()
    with atomic_dir(out) as tmp:  # built beside, swapped in whole (an old one moved aside)
        manifest = _prepare_into(tmp, train_files, heldout_files, opts, progress, log)
        manifest.update(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            params_hash=params_hash,
            options=opts.model_dump(),
            inputs={"train": train_fp, "heldout": heldout_fp},
            seconds=round(time.time() - t0, 1),
        )
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(format_summary(manifest))
    return manifest


def _prepare_into(
    tmp: Path,
    train_files: list[Path],
    heldout_files: list[Path],
    opts: PrepareOptions,
    progress: bool,
    log,
) -> dict[str, Any]:
    stats: Counter = Counter()
    seen: set[int] = set()
    files = heldout_files + train_files  # held-out first: a training duplicate of it is dropped
    total_bytes = sum(f.stat().st_size for f in files)
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="read", disable=not progress, leave=False
    )
    n_split = {"train": 0, "heldout": 0}
    paths = {s: tmp / f"sentences.{s}.txt" for s in ("train", "heldout")}
    with (
        open(paths["train"], "w", encoding="utf-8") as ftrain,
        open(paths["heldout"], "w", encoding="utf-8") as fheld,
    ):
        for group, group_files in (("heldout", heldout_files), ("train", train_files)):
            for sent in _sentences_from(group_files, opts, stats, bar, log):
                stats["sentences_seen"] += 1
                if not T.has_word_chars(sent):
                    stats["skipped_no_letters"] += 1
                    continue
                if len(sent.split()) > opts.max_sentence_words:
                    stats["skipped_too_long"] += 1
                    continue
                h = _hash64(sent)
                if opts.dedupe:
                    if h in seen:
                        stats["skipped_duplicate"] += 1
                        continue
                    seen.add(h)
                if (
                    group == "heldout"
                    or not heldout_files
                    and (h % 100_000) < opts.heldout_fraction * 100_000
                ):
                    split = "heldout"
                else:
                    split = "train"
                (fheld if split == "heldout" else ftrain).write(sent + "\n")
                n_split[split] += 1
    bar.close()
    del seen
    skipped_files = stats["files_binary"] + stats["files_unreadable"]
    if n_split["train"] == 0:
        raise InputError(
            f"empty corpus: no usable training sentences in {len(train_files)} file(s) "
            f"({stats['files_read']} read, {skipped_files} skipped as binary/unreadable, "
            f"{stats['lines']} lines, {stats['sentences_seen']} sentences before filtering)",
            field="inputs",
        )
    if n_split["heldout"] == 0:
        log(
            "warning: the held-out split is empty (raise --heldout-fraction or pass --heldout FILE)"
        )

    vocab, counts, softmax_size, shards = _tokenize(tmp, paths, opts, log, progress)
    for sh in (sh for split in shards.values() for sh in split):  # checked at every load
        sh["sha256"] = {
            kind: sha256_file(tmp / "shards" / f"{sh['name']}.{kind}.npy")
            for kind in ("tokens", "offsets")
        }
    if softmax_size < opts.vocab_size and not opts.sp_model:
        why = (
            f"the training text has only {softmax_size - len(SPECIALS)} distinct words"
            if opts.tokenizer == "word"
            else "sentencepiece found no more pieces in this little text"
        )
        log(
            f"note: the vocabulary has {softmax_size} entries, not the {opts.vocab_size} asked "
            f"for (--vocab-size): {why}; the model's softmax will have {softmax_size} outputs"
        )
    with open(tmp / "vocab.txt", "w", encoding="utf-8") as f:
        for tok, c in zip(vocab, counts, strict=True):
            f.write(f"{tok}\t{c}\n")
    n_tokens = {s: sum(sh["tokens"] for sh in shards[s]) for s in shards}
    unk_train = int(counts[UNK_ID])
    summary = dict(stats)
    summary.update(
        train_sentences=n_split["train"],
        heldout_sentences=n_split["heldout"],
        train_tokens=n_tokens["train"],
        heldout_tokens=n_tokens["heldout"],
        train_unk_rate=round(unk_train / max(1, n_tokens["train"] + n_split["train"]), 6),
    )
    return {
        "tokenizer": {
            "type": opts.tokenizer,
            "lowercase": opts.lowercase,
            "pretokenized": opts.pretokenized,
        },
        "vocab": {
            "file": "vocab.txt",
            "size": len(vocab),
            "softmax_size": softmax_size,
            "requested_size": softmax_size if opts.sp_model else opts.vocab_size,
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
            "unk_id": UNK_ID,
        },
        "shards": shards,
        "summary": summary,
    }


def _tokenize(tmp: Path, paths: dict[str, Path], opts: PrepareOptions, log, progress: bool):
    shard_dir = tmp / "shards"
    shard_dir.mkdir()
    if opts.tokenizer == "sentencepiece":
        return _tokenize_sp(tmp, shard_dir, paths, opts, log, progress)
    return _tokenize_words(shard_dir, paths, opts, progress)


def count_lines(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def _encode_file(path: Path, encode, writer: ShardWriter, progress: bool, desc: str) -> None:
    chunk: list[str] = []
    n = count_lines(path)
    with (
        open(path, encoding="utf-8") as f,
        tqdm(total=n, desc=desc, unit="sent", disable=not progress, leave=False) as bar,
    ):
        for line in f:
            chunk.append(line.rstrip("\n"))
            if len(chunk) == 4096:
                for ids in encode(chunk):
                    writer.add(ids)
                bar.update(len(chunk))
                chunk = []
        if chunk:
            for ids in encode(chunk):
                writer.add(ids)
            bar.update(len(chunk))
    writer.flush()


# scripts with thousands of characters (Han, kana, Hangul syllables): sentencepiece's
# advice is a coverage of 0.9995 for them, 1.0 for alphabets
_RICH_SCRIPT = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_LATIN = re.compile("[A-Za-z\u00c0-\u024f]")


def coverage_for(train: Path, opts: PrepareOptions, sample_chars: int = 2_000_000) -> float:
    """The character coverage asked, else the one for the script of the training text's
    first ``sample_chars`` letters: rich scripts over a fifth of them -> 0.9995, mostly Latin
    -> 0.9995 (sentencepiece's default, as before), another alphabet -> 1.0."""
    if opts.character_coverage is not None:
        return opts.character_coverage
    with open(train, encoding="utf-8") as f:
        sample = f.read(sample_chars)
    letters = max(1, sum(ch.isalpha() for ch in sample))
    if len(_RICH_SCRIPT.findall(sample)) > 0.2 * letters:
        return RICH_SCRIPT_COVERAGE
    if len(_LATIN.findall(sample)) > 0.5 * letters:
        return LATIN_COVERAGE
    return ALPHABET_COVERAGE  # Cyrillic, Greek, Arabic...: a small alphabet, all of it


def _train_sp(tmp: Path, paths: dict[str, Path], opts: PrepareOptions, log) -> None:
    import sentencepiece as spm

    coverage = coverage_for(paths["train"], opts)
    log(
        f"training sentencepiece ({opts.sp_model_type}, vocab {opts.vocab_size}, "
        f"character coverage {coverage})..."
    )
    try:
        spm.SentencePieceTrainer.train(
            input=str(paths["train"]),
            model_prefix=str(tmp / "tokenizer"),
            vocab_size=opts.vocab_size - 2,  # + <S>, </S> = the softmax size
            model_type=opts.sp_model_type,
            character_coverage=coverage,
            byte_fallback=opts.byte_fallback,
            input_sentence_size=opts.sp_input_sentences,
            shuffle_input_sentence=True,
            hard_vocab_limit=False,
            bos_id=-1,
            eos_id=-1,
            unk_id=0,
            num_threads=max(1, opts.threads),
            seed_sentencepiece_size=1_000_000,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise InputError(f"sentencepiece training failed: {e}", field="vocab_size") from e
    (tmp / "tokenizer.vocab").unlink(missing_ok=True)


def _tokenize_sp(tmp, shard_dir, paths, opts: PrepareOptions, log, progress):
    import sentencepiece as spm

    if opts.sp_model:  # the given tokenizer, kept as it is
        shutil.copyfile(opts.sp_model, tmp / "tokenizer.model")
    else:
        _train_sp(tmp, paths, opts, log)
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "tokenizer.model"))
    n_sp = sp.get_piece_size()

    def encode(lines):
        return [np.asarray(x, dtype=np.int32) for x in sp.encode(lines)]

    shards = {}
    for split in ("train", "heldout"):
        w = ShardWriter(shard_dir, split, opts.shard_tokens)
        _encode_file(paths[split], encode, w, progress, f"encode {split}")
        shards[split] = w.shards
    # our ids: specials, then pieces by training count (ties: sentencepiece order)
    counts = np.zeros(n_sp, dtype=np.int64)
    for sh in shards["train"]:
        counts += np.bincount(np.load(shard_dir / f"{sh['name']}.tokens.npy"), minlength=n_sp)
    pieces = [i for i in range(n_sp) if i != sp.unk_id()]
    pieces.sort(key=lambda i: (-counts[i], i))
    remap = np.full(n_sp, UNK_ID, dtype=np.int32)
    remap[pieces] = np.arange(len(SPECIALS), len(SPECIALS) + len(pieces), dtype=np.int32)
    for split in shards:
        for sh in shards[split]:
            p = shard_dir / f"{sh['name']}.tokens.npy"
            np.save(p, remap[np.load(p)])
    n_sent = sum(sh["sentences"] for sh in shards["train"])
    vocab = list(SPECIALS) + [sp.id_to_piece(i) for i in pieces]
    vocab_counts = [n_sent, n_sent, int(counts[sp.unk_id()])] + [int(counts[i]) for i in pieces]
    return vocab, vocab_counts, len(vocab), shards


def _word_split(opts: PrepareOptions):
    if opts.pretokenized:
        return str.split
    from elmo_service.tokenizers import WordTokenizer

    tok = WordTokenizer(lowercase=opts.lowercase)
    return lambda s: [t.piece for t in tok.tokenize(s)]


def _tokenize_words(shard_dir, paths, opts: PrepareOptions, progress):
    split_words = _word_split(opts)
    counts: Counter = Counter()
    with open(paths["train"], encoding="utf-8") as f:
        for line in tqdm(f, desc="count words", unit="sent", disable=not progress, leave=False):
            counts.update(split_words(line))
    n_sent = count_lines(paths["train"])
    unk_count = counts.pop(UNK, 0)  # a literal <unk> in the text (PTB) is our <unk>
    for s in (BOS, EOS):
        counts.pop(s, None)
    words = sorted(counts, key=lambda w: (-counts[w], w))
    vocab = list(SPECIALS) + words
    softmax_size = min(len(vocab), opts.vocab_size)
    unk_count += sum(counts[w] for w in words[softmax_size - len(SPECIALS) :])
    vocab_counts = [n_sent, n_sent, unk_count] + [counts[w] for w in words]
    index = {w: i for i, w in enumerate(vocab)}

    def encode(lines):
        out = []
        for line in lines:
            ids = []
            for w in split_words(line):
                i = index.get(w)
                if i is None:  # held-out only word: new id, spelled for the char CNN, target <unk>
                    i = index[w] = len(vocab)
                    vocab.append(w)
                    vocab_counts.append(0)
                ids.append(i)
            out.append(np.asarray(ids, dtype=np.int32))
        return out

    shards = {}
    for split in ("train", "heldout"):
        w = ShardWriter(shard_dir, split, opts.shard_tokens)
        _encode_file(paths[split], encode, w, progress, f"encode {split}")
        shards[split] = w.shards
    return vocab, vocab_counts, softmax_size, shards


def format_summary(m: dict[str, Any]) -> str:
    s = m["summary"]
    v = m["vocab"]
    lines = [
        f"prepared corpus ({m['seconds']} s):",
        f"  files: {s.get('files_read', 0)} read, {s.get('files_binary', 0)} skipped as binary",
        f"  lines: {s.get('lines', 0)}; invalid UTF-8: {s.get('lines_bad_utf8', 0)} lines "
        f"({'replaced' if m['options']['encoding_errors'] == 'replace' else 'skipped'}, "
        f"{s.get('bad_bytes_replaced', 0)} replacement chars); too long (> {m['options']['max_line_chars']} chars): {s.get('lines_too_long', 0)}",
        f"  sentences: {s.get('sentences_seen', 0)} found; skipped {s.get('skipped_duplicate', 0)} duplicates, "
        f"{s.get('skipped_no_letters', 0)} without letters/digits, {s.get('skipped_too_long', 0)} over {m['options']['max_sentence_words']} words",
        f"  kept: train {s['train_sentences']} sentences / {s['train_tokens']} tokens, held-out {s['heldout_sentences']} / {s['heldout_tokens']}",
        f"  vocab: {v['size']} tokens ({m['tokenizer']['type']}), softmax {v['softmax_size']}"
        + (
            f" (asked for {v['requested_size']})"
            if v.get("requested_size", 0) > v["softmax_size"]
            else ""
        )
        + f", train <unk> rate {s['train_unk_rate']:.4%}",
    ]
    return "\n".join(lines)
