"""``elmo-service`` core commands: convert, embed-file, info.

The service commands (``serve``, ``worker``) are added by ``api.cli``, which
is the console script's entry point; this module never imports ``api``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from elmo_service.atomic import atomic_path
from elmo_service.batching import DEFAULT_BATCH_TOKENS
from elmo_service.config import PRECISIONS, WEIGHT_MODES
from elmo_service.errors import PATH_ERRORS, ElmoServiceError, InputError
from elmo_service.process import configure_process


def _chunks(lines: Iterator[str], n: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line.rstrip("\n"))
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _scan_lines(path: Path) -> tuple[int, list[int]]:
    """(number of lines, 1-based numbers of the blank ones) in one pass."""
    n, blank = 0, []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):  # noqa: B007 - n is the count after the loop
            if not line.strip():
                blank.append(n)
    return n, blank


def _line_message(e: InputError, path: Path, first: int) -> str:
    """An embedder error about "sentence k[, word j]" of a chunk, told as the file's line
    ``first + k + 1`` (and word ``j + 1``)."""
    m = re.search(r"sentence (\d+)(, word (\d+))?", e.message)
    if m is None:
        return f"{path}: {e.message}"
    where = f"line {first + int(m.group(1)) + 1} of {path}"
    if m.group(3) is not None:
        where += f", word {int(m.group(3)) + 1}"
    return e.message[: m.start()] + where + e.message[m.end() :]


def cmd_embed_file(args: argparse.Namespace) -> int:
    """Write AllenNLP ``elmo`` command's HDF5 layout: one dataset per line
    index (``--all``: ``[L+1, T, D]``; ``--top``/``--average``/``--task``:
    ``[T, D]``) plus ``sentence_to_index`` (a JSON string).

    Blank lines are refused, as ``allennlp elmo`` refuses them: dataset ``i``
    is line ``i``, and an empty sentence has no vectors to store."""
    import h5py
    import numpy as np
    from tqdm import tqdm

    from elmo_service.artifact import default_model_dir
    from elmo_service.embedder import Embedder, apply_mix, words_of
    from elmo_service.scalar_mix import MixSpec

    in_path = Path(args.input)
    if not in_path.is_file():
        raise ElmoServiceError(f"{in_path}: not a file (missing, or a folder)", field="input")
    if not Path(args.output).resolve().parent.is_dir():
        raise ElmoServiceError(
            f"{args.output}: its folder {Path(args.output).resolve().parent} does not exist",
            field="output",
        )
    total, blank = _scan_lines(in_path)  # before loading the model: fail fast
    if blank:
        shown = ", ".join(map(str, blank[:5])) + (
            f" (and {len(blank) - 5} more)" if len(blank) > 5 else ""
        )
        raise ElmoServiceError(
            f"{in_path} has blank lines ({shown}); give one sentence a line, as AllenNLP's "
            "`elmo` command requires (e.g. drop them with: grep -v '^[[:space:]]*$')",
            field="input",
        )
    model = Path(args.model) if args.model else default_model_dir()
    emb = Embedder.load(
        model,
        threads=args.threads,
        precision=args.precision,
        batch_tokens=args.batch_tokens,
        device=args.device,
        weights=args.weights,
    )
    if args.task:
        if args.task not in emb.artifact.tasks:
            known = ", ".join(sorted(emb.artifact.tasks)) or "none"
            raise ElmoServiceError(
                f"model has no task {args.task!r} (tasks: {known})", field="task"
            )
        spec = emb.artifact.tasks[args.task]
    elif args.average:
        spec = MixSpec.average(emb.n_layers)
    else:
        spec = None

    granularity = _granularity(args)
    sentence_to_index: dict[str, str] = {}
    out = Path(args.output)
    with (
        atomic_path(out) as tmp,  # a crash never leaves a half-written OUT behind
        in_path.open(encoding="utf-8", errors="replace") as fin,
        h5py.File(tmp, "w") as fout,
        tqdm(total=total, unit="sent", disable=args.quiet) as bar,
    ):
        index = 0
        for chunk in _chunks(fin, args.chunk_lines):
            inputs = [line.split() for line in chunk] if args.whitespace else chunk
            try:
                results = emb.embed(inputs)
            except InputError as e:  # name the file's line, not the chunk's sentence index
                raise InputError(_line_message(e, in_path, index), field="input") from e
            for line, sent, res in zip(chunk, inputs, results, strict=True):
                if not res.tokens:  # e.g. a line of characters the tokenizer removes (U+200B)
                    raise InputError(
                        f"line {index + 1} of {in_path} has no tokens for this model's "
                        "tokenizer: nothing to store under its index",
                        field="input",
                    )
                layers = res.layers
                if granularity == "word":
                    _, layers = words_of(res.tokens, layers, None if args.whitespace else sent)
                if args.top:
                    data = layers[-1]
                elif spec is not None:
                    data = apply_mix(layers, spec)
                else:
                    data = layers
                if not np.isfinite(data).all():  # never write a NaN a reader would trust
                    raise ElmoServiceError(
                        f"line {index + 1} of {in_path}: the model produced non-finite values",
                        field="input",
                    )
                fout.create_dataset(str(index), data=data, dtype="float32")
                sentence_to_index[line] = str(index)
                index += 1
            bar.update(len(chunk))
        ds = fout.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
        ds[0] = json.dumps(sentence_to_index)
        fout.attrs["granularity"] = granularity  # which positions the datasets hold
    pieces = granularity == "token" and emb.tokenizer.kind == "sentencepiece"
    note = "; one vector per sub-word piece, --granularity word gives one per word" * pieces
    print(f"wrote {index} sentences to {out} (model {model}{note})", file=sys.stderr)
    return 0


def cmd_embed_bulk(args: argparse.Namespace) -> int:
    """Ray Data over Parquet shards (elmo_service/bulk/; docs/bulk.md)."""
    from elmo_service.artifact import default_model_dir
    from elmo_service.bulk import BulkOptions, run_bulk

    output = args.output or ("mix" if args.task else "layers")
    opts = BulkOptions(
        output=output,
        task=args.task,
        pooling=args.pooling,
        granularity=_granularity(args),
        whitespace=args.whitespace,
        shard_rows=args.shard_rows,
        batch_tokens=args.batch_tokens,
    )
    try:
        summary = run_bulk(
            args.input,
            args.out,
            Path(args.model) if args.model else default_model_dir(),
            opts,
            actors=args.actors,
            threads=args.threads,
            address=args.address,
            skip_bad=args.skip_bad,
            verify=args.verify,
            progress=not args.quiet,
        )
    except KeyboardInterrupt:
        print(
            "\ninterrupted: the shards written so far are kept; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        # Ray (already shut down) can crash in the interpreter's teardown after an
        # interrupt; nothing is left to flush but the standard streams
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    skipped = f", {len(summary.skipped)} lines skipped (see {args.out}/_skipped.jsonl)"
    print(
        f"{summary.rows} sentences in {summary.shards} shard{'s' * (summary.shards != 1)} "
        f"under {args.out} "
        f"({summary.written} written now, {summary.done_before} kept from before"
        f"{skipped if summary.skipped else ''}; model {summary.version})",
        file=sys.stderr,
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from elmo_service.convert import convert_bilm

    version = convert_bilm(
        args.options, args.weights, args.out, lowercase=args.lowercase, overwrite=args.overwrite
    )
    print(f"wrote {args.out} (version {version})")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from elmo_service.artifact import load_artifact

    art = load_artifact(args.model)
    info = {
        "path": str(art.path),
        "version": art.version,
        "config": art.config.to_dict(),
        "tokenizer": art.tokenizer.kind,
        "tasks": sorted(art.tasks),
        "parameters": sum(p.numel() for p in art.model.parameters()),
        "provenance": art.provenance,
    }
    print(json.dumps(info, indent=2))
    return 0


def _add_tokenization(p: argparse.ArgumentParser) -> None:
    """embed-file's and embed-bulk's shared options: how lines become positions."""
    p.add_argument(
        "--granularity",
        choices=["token", "word"],
        default=None,
        help="word: one vector per word, its sub-word pieces averaged (AllenNLP's layout); "
        "token: one per model token (a sentencepiece model splits words into pieces). "
        "Default: word with --whitespace, else token",
    )
    p.add_argument(
        "--whitespace",
        action="store_true",
        help="lines are pre-tokenized: split on whitespace, not by the model's tokenizer "
        "(one vector per whitespace-separated word unless --granularity token)",
    )


def _granularity(args: argparse.Namespace) -> str:
    """Pre-tokenized input means one vector per given word, as AllenNLP users expect."""
    return args.granularity or ("word" if args.whitespace else "token")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elmo-service", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "convert", help="convert bilm-tf/AllenNLP options.json + weights.hdf5 to an artifact"
    )
    c.add_argument("--options", required=True, help="the model's options.json (bilm-tf/AllenNLP)")
    c.add_argument("--weights", required=True, help="its weights.hdf5")
    c.add_argument("--out", required=True, help="artifact folder to write, e.g. models/elmo-small")
    c.add_argument(
        "--lowercase", action="store_true", help="the model was trained on lowercased text"
    )
    c.add_argument("--overwrite", action="store_true", help="replace an existing artifact in --out")
    c.set_defaults(func=cmd_convert)

    e = sub.add_parser(
        "embed-file",
        help="embed one sentence per line into HDF5 (AllenNLP 'elmo' layout)",
        description="Embed a text file, one sentence a line (no blank lines, as in AllenNLP's "
        "`elmo` command), into HDF5: dataset 'i' holds line i's vectors, and "
        "'sentence_to_index' maps each line to its dataset. Positions are the model's tokens, "
        "or words with --whitespace or --granularity word.",
    )
    e.add_argument("input", help="text file, UTF-8, one sentence a line")
    e.add_argument("output", help="HDF5 file to write (replaced only once complete)")
    e.add_argument(
        "--model",
        default=None,
        help="model directory (default: the one `serve` serves: $ELMO_MODEL_PATH, else "
        "$ELMO_MODELS_DIR/$ELMO_MODEL, else the bundled models/default)",
    )
    what = e.add_mutually_exclusive_group()
    what.add_argument("--all", action="store_true", help="all layers [L+1, T, D] (default)")
    what.add_argument("--top", action="store_true", help="top layer only [T, D]")
    what.add_argument(
        "--average", action="store_true", help="equal-weight mix of all layers [T, D]"
    )
    what.add_argument("--task", help="a task mix stored with the model (MODEL/tasks/) [T, D]")
    _add_tokenization(e)
    e.add_argument(
        "--batch-tokens",
        type=int,
        default=DEFAULT_BATCH_TOKENS,
        help=f"padded tokens per model batch (default {DEFAULT_BATCH_TOKENS})",
    )
    e.add_argument(
        "--chunk-lines", type=int, default=1024, help="lines read per step (bounds memory)"
    )
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    e.add_argument("--device", default="auto", help="cpu | cuda | auto (CUDA when available)")
    e.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32 (default) | bf16 autocast | fp16 (CUDA) | auto (bf16 where the CPU has it natively)",
    )
    e.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="fp32",
        help="int8: int8 weights for the big matmuls (CPU, fp32 precision); "
        "see docs/bench-embedder.md for speed and error",
    )
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_embed_file)

    b = sub.add_parser(
        "embed-bulk",
        help="embed a corpus into Parquet shards on Ray Data (pip install 'elmo-service[bulk]')",
        description="Embed text files (one sentence a line) into Parquet shards under --out, "
        "on a Ray Data actor pool (a local cluster, or --address). A re-run skips the shards "
        "already written and verified. Layout: docs/bulk.md.",
    )
    b.add_argument("input", nargs="+", help="text files, UTF-8, one sentence a line")
    b.add_argument("--out", required=True, help="folder of Parquet shards (shared by all nodes)")
    b.add_argument("--model", default=None, help="model directory (default: as embed-file)")
    b.add_argument(
        "--output",
        choices=["layers", "mix"],
        default=None,
        help="layers: all L+1 layers per position; mix: one scalar mix "
        "(--task, else the model's 'default' task, else the average). Default: mix with "
        "--task, else layers",
    )
    b.add_argument("--task", default=None, help="a task mix stored with the model (MODEL/tasks/)")
    b.add_argument(
        "--pooling",
        choices=["none", "mean", "max"],
        default="none",
        help="none: a vector per token (or word); mean/max: one vector per sentence",
    )
    _add_tokenization(b)
    b.add_argument(
        "--actors", type=int, default=None, help="model actors (default: one per cluster CPU)"
    )
    b.add_argument("--threads", type=int, default=1, help="torch threads (and CPUs) per actor")
    b.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: start a local one)"
    )
    b.add_argument(
        "--shard-rows",
        type=int,
        default=10_000,
        help="input lines per shard: the unit of work and of resume (default 10000)",
    )
    b.add_argument(
        "--batch-tokens",
        type=int,
        default=DEFAULT_BATCH_TOKENS,
        help=f"padded tokens per model batch (default {DEFAULT_BATCH_TOKENS})",
    )
    b.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip blank, non-UTF-8 and over-limit lines (listed in OUT/_skipped.jsonl) "
        "instead of stopping at the first",
    )
    b.add_argument(
        "--verify",
        choices=["full", "quick"],
        default="full",
        help="how a re-run checks the shards already written: full: size and sha256 "
        "(reads them all); quick: size and the Parquet footer's row count",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_embed_bulk)

    i = sub.add_parser("info", help="print an artifact's config, version and provenance")
    i.add_argument("model", help="an artifact folder, e.g. models/default")
    i.set_defaults(func=cmd_info)
    return p


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        if getattr(args, "role", "cli") == "cli":  # serve and worker set themselves up
            configure_process("cli", getattr(args, "threads", None))
        return args.func(args)
    except ElmoServiceError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except PATH_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
