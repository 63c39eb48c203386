"""``elmo-service`` core commands: convert, embed-file, info.

The service commands (``serve``, ``worker``) are added by ``elmo_cli.main``, which
is the console script's entry point; this module never imports ``api``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elmo_service.bilm.config import DEFAULT_BATCH_TOKENS, PRECISIONS, WEIGHT_MODES
from elmo_service.errors import PATH_ERRORS, ElmoServiceError
from elmo_service.process import configure_process


def cmd_embed_file(args: argparse.Namespace) -> int:
    """Write AllenNLP ``elmo`` command's HDF5 layout (``elmo_service/embed_file.py``): one
    dataset per line index (``--all``: ``[L+1, T, D]``; ``--top``/``--average``/``--task``:
    ``[T, D]``) plus ``sentence_to_index`` (a JSON string). Blank lines are refused, as
    ``allennlp elmo`` refuses them."""
    from elmo_service.artifact import default_model_dir
    from elmo_service.document import check_at_once
    from elmo_service.embed_file import check_lines, check_output, file_spec
    from elmo_service.embedder import Embedder

    in_path, out = Path(args.input), Path(args.output)
    total = check_lines(in_path, args.documents)  # before loading the model: fail fast
    check_output(out)
    check_at_once(args.documents_at_once)
    model = Path(args.model) if args.model else default_model_dir()
    emb = Embedder.load(
        model,
        threads=args.threads,
        precision=args.precision,
        batch_tokens=args.batch_tokens,
        device=args.device,
        weights=args.weights,
    )
    what = "top" if args.top else "average" if args.average else "all"
    granularity = _granularity(args)
    file_spec(emb, what, args.task, granularity)  # a bad --task fails before any work
    n = emb.embed_file(
        in_path,
        out,
        what=what,
        task=args.task,
        granularity=granularity,
        whitespace=args.whitespace,
        chunk_lines=args.chunk_lines,
        progress=not args.quiet,
        lines=total,
        documents=args.documents,
        chunk_tokens=args.chunk_tokens,
        documents_at_once=args.documents_at_once,
    )
    pieces = granularity == "token" and emb.tokenizer.kind == "sentencepiece"
    note = "; one vector per sub-word piece, --granularity word gives one per word" * pieces
    print(
        f"wrote {n} sentence{'' if n == 1 else 's'} to {out} (model {model}{note})", file=sys.stderr
    )
    return 0


def cmd_embed_bulk(args: argparse.Namespace) -> int:
    """Ray Data over Parquet shards (bulk/; docs/bulk.md)."""
    from elmo_bulk import BulkOptions, run_bulk
    from elmo_service.artifact import default_model_dir
    from elmo_service.outputs import default_output

    output = args.output or default_output(task=args.task)
    opts = BulkOptions(
        output=output,
        task=args.task,
        pooling=args.pooling,
        granularity=_granularity(args),
        whitespace=args.whitespace,
        documents=args.documents,
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
    if args.manylangs:
        from elmo_service.convert_efml import convert_efml

        if args.options or args.weights or args.lowercase:
            raise SystemExit("convert: --manylangs takes no --options, --weights or --lowercase")
        version = convert_efml(
            args.manylangs, args.out, overwrite=args.overwrite, network_config=args.network_config
        )
        print(f"wrote {args.out} (version {version})")
        return 0
    from elmo_service.convert import convert_bilm

    if args.network_config:
        raise SystemExit("convert: --network-config goes with --manylangs")
    if not (args.options and args.weights):
        raise SystemExit("convert: give --options and --weights, or --manylangs DIR")
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
    from elmo_service.embed_file import default_granularity

    return args.granularity or default_granularity(args.whitespace)


def build_parser(more: Callable[[Any, Any], None] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; ``more(parser, subparsers)`` adds commands (cli/main.py: the server's)."""
    p = argparse.ArgumentParser(prog="elmo-service", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "convert",
        help="convert bilm-tf/AllenNLP options.json + weights.hdf5, or an ELMoForManyLangs "
        "model folder, to an artifact",
    )
    c.add_argument("--options", help="the model's options.json (bilm-tf/AllenNLP)")
    c.add_argument("--weights", help="its weights.hdf5")
    c.add_argument(
        "--manylangs",
        metavar="DIR",
        help="an ELMoForManyLangs model folder (config.json, char.dic, [word.dic], "
        "token_embedder.pkl, encoder.pkl) instead of --options/--weights",
    )
    c.add_argument(
        "--network-config",
        metavar="JSON",
        help="with --manylangs: its network config when config.json's config_path names "
        "no file inside the folder (a path outside the folder is never read unless given here)",
    )
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
    e.add_argument(
        "--documents",
        action="store_true",
        help="each line is a document, embedded as one sequence of any length (context "
        "across its sentences; docs/documents.md): dataset 'i' holds line i's vectors",
    )
    e.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="with --documents: tokens computed per step (bounds memory; the vectors do not "
        "depend on it)",
    )
    e.add_argument(
        "--documents-at-once",
        type=int,
        default=None,
        # the number is document.DOCUMENTS_AT_ONCE (that module imports torch; a test holds it)
        help="with --documents: documents computed together, a row each per step (default 64; "
        "the vectors do not depend on it)",
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
        help="int8 / bf16: the weights rounded once and streamed compact (CPU, fp32 "
        "precision; opt-in, faster for one sentence of a big model); its error against fp32 "
        "is measured at load (the certificate, logged); docs/bench-embedder.md",
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
        "--documents",
        action="store_true",
        help="each line is a document, embedded as one sequence of any length (a row per "
        "document; docs/documents.md)",
    )
    b.add_argument(
        "--actors", type=int, default=None, help="model actors (default: one per cluster CPU)"
    )
    b.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (and CPUs) per actor (default: the cluster's CPUs / --actors, else 1)",
    )
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
    if more is not None:
        more(p, sub)
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
