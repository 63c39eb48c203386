"""`elmo-pretrain`: prepare | train | adapt | eval | export | plot | synthetic | fetch-* | probe | finetune.

    elmo-pretrain prepare corpus/*.txt --out data/prepared --vocab-size 16000
    elmo-pretrain train configs/default.yaml --run-dir runs/default [--set optim.lr=3e-4] [--resume | --force]
    torchrun --nproc-per-node 2 -m elmo_pretrain.cli train configs/tiny.yaml --run-dir runs/ddp
    elmo-pretrain adapt models/default notes/*.txt --out models/notes [--steps 300] [--resume]
    elmo-pretrain eval runs/default [--split heldout | --file test.txt]
    elmo-pretrain export runs/default models/elmo-en
    elmo-pretrain plot runs/default              # runs/default/learning-curve.png

Errors the user can fix (bad input, bad config, a run folder in the way)
print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from elmo_service.process import configure_process

# Before torch loads OpenMP (the imports below): training never spins (the one process
# setup, elmo_service/process.py, says why); the commands set their thread counts
configure_process("train", set_threads=False)

from elmo_pretrain.finetune import add_finetune_commands  # noqa: E402
from elmo_pretrain.prepare import CLI_FIELDS, PrepareOptions  # noqa: E402
from elmo_pretrain.probe import add_probe_commands  # noqa: E402
from elmo_pretrain.sources.cli import add_source_commands  # noqa: E402
from elmo_service.errors import PATH_ERRORS, ElmoServiceError  # noqa: E402
from elmo_service.settings_base import add_arguments, from_args  # noqa: E402


def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare", help="text files/folders/globs -> cleaned sentences, tokenizer, token shards"
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="text files, folders (recursive) or globs; .gz/.bz2/.xz are read too",
    )
    p.add_argument(
        "--out", required=True, help="output folder (refused if it holds a different preparation)"
    )
    # every preparation option is a flag derived from PrepareOptions (name, type, default, help)
    add_arguments(p, PrepareOptions, CLI_FIELDS)
    p.add_argument(
        "--force", action="store_true", help="replace an existing, different preparation in --out"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a biLM from a YAML config")
    p.add_argument(
        "config",
        nargs="?",
        help="YAML config; with --resume, the run's saved config is used and the file "
        "(with the run's launch --set overrides) must agree with it, except for run length",
    )
    p.add_argument(
        "--run-dir",
        required=True,
        help="checkpoints, metrics.jsonl and the resolved config go here",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optim.lr=0.2 --set model.lstm_dim=512",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --run-dir"
    )
    g.add_argument(
        "--force", action="store_true", help="start over in a run folder that holds another run"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="checkpoint and exit after N steps in this invocation (train in slices; --resume continues)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="train in N processes on this machine (DDP, as torchrun --standalone; Ctrl-C or "
        "SIGTERM: each finishes its step, writes the checkpoint, exit 0)",
    )


def _add_adapt(sub) -> None:
    from elmo_pretrain.adapt_options import AdaptOptions

    p = sub.add_parser(
        "adapt",
        help="continue pretraining a model on your own text (domain adaptation): MODEL + CORPUS "
        "-> NEW_MODEL, with held-out perplexity before and after",
    )
    p.add_argument("model", help="the model to start from: any artifact folder (models/default)")
    p.add_argument(
        "corpus", nargs="+", help="text files, folders or globs (tokenized as MODEL does)"
    )
    p.add_argument("--out", required=True, help="the new model's folder, e.g. models/notes")
    add_arguments(p, AdaptOptions)  # every option a flag: --steps, --lr, --max-minutes, ...
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue the work folder's adaptation")
    g.add_argument(
        "--overwrite",
        "--force",
        dest="overwrite",
        action="store_true",
        help="start the adaptation over (its work folder's corpus and run) and replace an "
        "existing NEW_MODEL (--force: the name the trainer's refusals use)",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="checkpoint and exit after N steps in this invocation (--resume continues)",
    )


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="exact held-out perplexity (forward, backward, average)")
    p.add_argument("run_dir", help="a run folder (or a model exported with --lm)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--split", default="heldout", help="a split of the prepared corpus (default heldout)"
    )
    g.add_argument("--file", help="a text file, one sentence a line, tokenized like the corpus")
    p.add_argument(
        "--checkpoint",
        help="a checkpoint file, its name in the run folder, or a step (default: the newest)",
    )
    p.add_argument("--data", help="prepared corpus folder (default: the run's)")
    p.add_argument(
        "--max-sentences", type=int, default=0, help="score the first N sentences (0 = all)"
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="read the text as one stream with carried LSTM state (the LM literature's protocol); "
        "default: each sentence from a zero state, as served",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print JSON only")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a serving artifact (no softmax, no optimizer state)")
    p.add_argument("run_dir", help="the run folder to export from")
    p.add_argument("out", help="artifact folder to write, e.g. models/mine")
    p.add_argument(
        "--checkpoint",
        help="a checkpoint file, its name in the run folder, or a step (default: the newest)",
    )
    p.add_argument("--data", help="prepared corpus folder (default: the run's)")
    p.add_argument(
        "--no-eval", action="store_true", help="skip the held-out perplexity in the provenance"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact in OUT")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument(
        "--lm",
        action="store_true",
        help="export the whole LM (softmax included) for `elmo-pretrain eval OUT --file ...`",
    )


def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot", help="draw a run's metrics.jsonl as a PNG learning curve (needs matplotlib)"
    )
    p.add_argument("run_dir", help="a run folder, or a metrics.jsonl file")
    p.add_argument(
        "--out",
        help="PNG to write (default: RUN_DIR/learning-curve.png, or FILE with .png for a file)",
    )
    p.add_argument("--title", help="figure title (default: the run folder's name)")


def _add_synthetic(sub) -> None:
    p = sub.add_parser(
        "synthetic",
        help="write a small generated English-like corpus (no download): for smoke runs",
    )
    p.add_argument("--out", required=True, help="text file to write (its folder is created)")
    p.add_argument("--sentences", type=int, default=3000, help="how many (default 3000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elmo-pretrain", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_prepare(sub)
    _add_train(sub)
    _add_adapt(sub)
    _add_eval(sub)
    _add_export(sub)
    _add_plot(sub)
    _add_synthetic(sub)
    add_source_commands(sub)  # fetch-corpus, fetch-ptb, fetch-brown, fetch-polarity
    add_probe_commands(sub)  # probe pos|polarity: learn a task's scalar mix
    add_finetune_commands(sub)  # finetune pos|ner|polarity: ELMo + baseline vs baseline
    return parser


def cmd_prepare(a) -> int:
    from elmo_pretrain.prepare import prepare

    opts = from_args(PrepareOptions, a)
    prepare(a.inputs, a.out, opts, force=a.force, progress=not a.no_progress)
    return 0


def _say_error(command: str, e: ElmoServiceError) -> None:
    print(f"elmo-pretrain {command}: error: {e.message}", file=sys.stderr, flush=True)


def cmd_train(a) -> int:
    from pathlib import Path

    from elmo_pretrain.config import dump_config
    from elmo_pretrain.ddp import dist_env
    from elmo_pretrain.launch import read_launch, write_launch
    from elmo_pretrain.run_checks import check_run_dir, resolve_config
    from elmo_pretrain.train import run_training

    run_dir = Path(a.run_dir)
    cfg = resolve_config(a.config, a.overrides, run_dir, a.resume)  # all config errors surface here
    if a.print_config:
        print(dump_config(cfg), end="")
        return 0
    # refuse a run folder in the way before recording anything in it: the rank that records
    # checks (another rank could meet rank 0's record half-written and refuse the folder);
    # the trainer checks again on every rank, between barriers
    rank = dist_env()[0]
    mode = check_run_dir(run_dir, cfg, a.resume, a.force) if rank == 0 else None
    if a.nproc_per_node and a.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        from elmo_pretrain.launch import launch_local

        return launch_local(a.nproc_per_node, _without_option(a.argv[1:], "--nproc-per-node"))
    if rank == 0:
        launch = read_launch(run_dir) if mode == "resume" else None
        if mode != "resume":
            write_launch(run_dir, a.config, a.overrides)
        elif launch is not None:  # later resumes keep what this one changed (e.g. train.steps)
            write_launch(run_dir, launch.get("config"), [*launch["overrides"], *a.overrides])
    run_training(
        cfg,
        a.run_dir,
        resume=a.resume,
        force=a.force,
        stop_after=a.stop_after,
        hand_on_signals=False,  # this process is the run: a signal means checkpoint, exit 0
        say=lambda e: _say_error("train", e),
    )
    return 0


def cmd_adapt(a) -> int:
    from elmo_pretrain.adapt import adapt
    from elmo_pretrain.adapt_options import AdaptOptions

    adapt(
        a.model,
        a.corpus,
        a.out,
        from_args(AdaptOptions, a),
        resume=a.resume,
        overwrite=a.overwrite,
        stop_after=a.stop_after,
        hand_on_signals=False,  # as train: a signal means checkpoint, exit 0
    )
    return 0


def _without_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag VALUE`` / ``flag=VALUE`` (the workers' command line)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def cmd_eval(a) -> int:
    from elmo_pretrain.evaluate import evaluate
    from elmo_pretrain.tracking import dumps

    res = evaluate(
        a.run_dir,
        split=a.split,
        file=a.file,
        checkpoint=a.checkpoint,
        data_path=a.data,
        threads=a.threads,
        max_sentences=a.max_sentences,
        stream=a.stream,
        progress=not a.json and sys.stderr.isatty(),
    )
    if a.json:
        print(dumps(res))  # an overflowed perplexity as null, not a bare Infinity
    else:
        print(
            f"{res['source']} at {res['checkpoint']} (step {res['step']}), {res['protocol']} protocol: "
            f"{res['sentences']} sentences, {res['predictions']} predictions"
        )
        for k in ("forward_ppl", "backward_ppl", "avg_ppl"):
            if k in res:
                print(f"  {k:13s} {res[k]:.3f}")
    return 0


def cmd_export(a) -> int:
    from elmo_pretrain.export import export, export_lm

    if a.lm:
        from elmo_service.runtime import set_threads

        set_threads(a.threads)
        res = export_lm(
            a.run_dir, a.out, checkpoint=a.checkpoint, data_path=a.data, overwrite=a.overwrite
        )
        print(f"exported the LM to {res['out']} ({res['bytes'] / 1e6:.1f} MB, step {res['step']})")
        return 0
    res = export(
        a.run_dir,
        a.out,
        checkpoint=a.checkpoint,
        data_path=a.data,
        evaluate_heldout=not a.no_eval,
        threads=a.threads,
        overwrite=a.overwrite,
        progress=sys.stderr.isatty(),
    )
    print(
        f"exported {res['out']} (version {res['version']}, step {res['step']}, {res['tokens_seen']} tokens seen)"
    )
    if res.get("warning"):
        print(f"  warning: {res['warning']}", file=sys.stderr)
    if res.get("heldout"):
        print(
            "  held-out: "
            + ", ".join(
                f"{k} {v if v is None else format(v, '.2f')}"
                for k, v in res["heldout"].items()
                if k.endswith("ppl")
            )
        )
    return 0


def cmd_plot(a) -> int:
    from pathlib import Path

    from elmo_pretrain.plot import plot_metrics

    src = Path(a.run_dir)
    out = a.out or (src / "learning-curve.png" if src.is_dir() else src.with_suffix(".png"))
    print(f"wrote {plot_metrics(src, out, title=a.title)}")
    return 0


def cmd_synthetic(a) -> int:
    from pathlib import Path

    from elmo_pretrain.sources.synthetic import write_corpus

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_corpus(out, n_sentences=a.sentences, seed=a.seed)
    print(f"wrote {a.sentences} sentence{'' if a.sentences == 1 else 's'} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for reports that quote the command
    handler = {
        "prepare": cmd_prepare,
        "train": cmd_train,
        "adapt": cmd_adapt,
        "eval": cmd_eval,
        "export": cmd_export,
        "plot": cmd_plot,
        "synthetic": cmd_synthetic,
    }.get(args.command)
    if handler is None:  # a command added by elmo_pretrain.sources carries its own handler
        func = getattr(args, "func", None)
        if func is None:
            print(f"elmo-pretrain: no handler for {args.command!r}", file=sys.stderr)
            return 2
        handler = func
    try:
        return int(handler(args) or 0)
    except ElmoServiceError as e:
        # DDP: every rank stops alike, one says why (the trainer's rank 0 may have said it)
        if os.environ.get("RANK", "0") == "0" and not getattr(e, "said", False):
            _say_error(args.command, e)
        return 2
    except PATH_ERRORS as e:  # one line, not a traceback
        print(f"elmo-pretrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        # the interpreter's last garbage collection walks every object torch.compile left
        # (seconds after a compiled run, e.g. on a SIGTERM); the OS frees them anyway
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
