"""`elmo-pretrain adapt MODEL CORPUS... --out NEW_MODEL`: continue pretraining a model on
your own text (domain adaptation, ELMo paper section 3.4).

    model = read MODEL (any artifact: trained here, or a converted bilm-tf / AllenNLP ELMo)
    prepare CORPUS with MODEL's own tokenizer          -> WORK/corpus (a held-out slice aside)
    LM = MODEL's biLM + a softmax (MODEL's, or initialised, see below)
    ppl before = held-out perplexity; train (the trainer: progress, checkpoints, resume,
    signals, divergence); ppl after = held-out perplexity at export -> NEW_MODEL

The held-out slice is chosen by ``prepare`` (a stable hash of each sentence) and lives in its
own shards: the trainer's batches read the ``train`` split only, so it never trains.

The softmax. An artifact is the biLM only, so a model needs its LM head from somewhere:

* ``NEW_MODEL/softmax.safetensors``: every model ``adapt`` writes ships its softmax (rows
  keyed by token string), so adapting it again continues exactly where it stopped;
* otherwise (``models/default``, whose training run is not shipped, or a converted published
  ELMo) a softmax is initialised from the model's own token representations: row ``w`` is the
  character CNN's vector of token ``w`` (tied input/output embeddings, Press & Wolf 2017) and
  its bias the log unigram frequency of ``w`` in CORPUS. The "before" perplexity is measured
  with that head, so it includes the head's untrained start: the provenance says which head
  was used (``adapt.softmax``).

Forgetting: when MODEL ships ``heldout.txt`` (``adapt --ship-heldout`` writes the held-out
slice there) or ``--forgetting-text FILE`` is given, its perplexity is measured before and
after too.

Python API (``elmo_pretrain.finetune`` calls it)::

    from elmo_pretrain.adapt import AdaptOptions, adapt
    res = adapt("models/default", ["notes.txt"], "models/notes", AdaptOptions(steps=200))
    res.heldout_before["avg_ppl"], res.heldout_after["avg_ppl"], res.seconds, res.version
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elmo_pretrain.adapt_options import ADAPT_FILE, HELDOUT_FILE, AdaptOptions, train_config_for
from elmo_pretrain.data import Corpus
from elmo_pretrain.evaluate import perplexity
from elmo_pretrain.export import export
from elmo_pretrain.lm import LanguageModel
from elmo_pretrain.prepare import PrepareOptions, prepare
from elmo_pretrain.tracking import json_safe
from elmo_pretrain.train import Remedies, Trainer
from elmo_service.artifact import Artifact, load_artifact, read_header
from elmo_service.atomic import atomic_path, write_json, write_text
from elmo_service.errors import PATH_ERRORS, ElmoServiceError, InputError
from elmo_service.runtime import set_threads
from elmo_service.scalar_mix import MixSpec

SOFTMAX_FILE = "softmax.safetensors"  # in an artifact adapt wrote: its LM head, keyed by token
# what the trainer's refusals tell an `adapt` user to do (its flags, not train's --set keys)
ADAPT_REMEDIES = Remedies(lower_lr="lower --lr", skip_nonfinite=None)


class AdaptWriteFailed(ElmoServiceError):
    """A checkpoint or NEW_MODEL could not be written (a full disk): the last good
    checkpoint stays, and ``--resume`` continues from it."""

    code = "write_failed"


@dataclass
class AdaptResult:
    out: str
    version: str
    work_dir: str
    step: int
    stopped: str  # the trainer's words: "done", "time limit", "signal SIGINT", ...
    seconds: float  # training time, across resumes
    softmax: str  # where the LM head came from
    heldout_before: dict[str, float]
    heldout_after: dict[str, float] | None
    forgetting_before: dict[str, float] | None = None
    forgetting_after: dict[str, float] | None = None
    exported: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))


def read_model(model_dir: str | Path) -> tuple[Artifact, dict[str, Any]]:
    """MODEL as an artifact (checked: manifest, hashes, weights) and its tokenizer entry, or
    one line saying why not."""
    path = Path(model_dir)
    if not path.is_dir():
        raise InputError(f"model {model_dir}: no such folder", field="model")
    if not (path / "manifest.json").is_file() or not (path / "config.json").is_file():
        raise InputError(
            f"model {model_dir} is not a model artifact (no manifest.json / config.json); give "
            "a folder written by `elmo-pretrain export` or `elmo-service convert`",
            field="model",
        )
    return load_artifact(path), read_header(path).tokenizer


def work_dir_for(out: str | Path, opts: AdaptOptions) -> Path:
    return Path(opts.work_dir) if opts.work_dir else Path("runs") / "adapt" / Path(out).name


def _prepare_options(model_dir: Path, tok: dict[str, Any], opts: AdaptOptions) -> PrepareOptions:
    """CORPUS is tokenized as MODEL tokenizes (its sentencepiece model, or its words)."""
    common = dict(heldout_fraction=opts.heldout_fraction, split=opts.split, seed=opts.seed)
    if tok.get("type") == "sentencepiece":
        return PrepareOptions(
            tokenizer="sentencepiece", sp_model=str(model_dir / tok["file"]), **common
        )
    return PrepareOptions(
        tokenizer="word",
        lowercase=bool(tok.get("lowercase", False)),
        vocab_size=opts.word_vocab_size,
        **common,
    )


def _check_corpus(corpus: Corpus, inputs: list[str]) -> None:
    """Refuse a corpus the model's tokenizer turns into nothing, or one too small to hold
    a slice out: before any training."""
    counts = _vocab_counts(corpus)
    # tokens that carry text: not <unk>, not sentencepiece's bare word-start piece
    known = sum(int(counts[i]) for i, w in enumerate(corpus.vocab[3:], 3) if w.strip("\u2581"))
    named = ", ".join(inputs[:3]) + (" ..." if len(inputs) > 3 else "")
    if known == 0:
        raise InputError(
            f"corpus {named}: the model's tokenizer turns it into nothing but <unk> "
            "(a script or language the model's vocabulary lacks)",
            field="corpus",
        )
    if len(corpus.split("heldout")) == 0:
        raise InputError(
            f"corpus {named}: too small to set a held-out slice aside "
            f"({len(corpus.split('train'))} sentences); give more text or raise --heldout-fraction",
            field="corpus",
        )


def _vocab_counts(corpus: Corpus) -> np.ndarray:
    lines = (corpus.path / corpus.manifest["vocab"]["file"]).read_text(encoding="utf-8")
    return np.asarray([int(x.rsplit("\t", 1)[1]) for x in lines.splitlines()], dtype=np.int64)


def _shipped_softmax(model_dir: Path) -> tuple[dict[str, torch.Tensor], list[str]] | None:
    path = model_dir / SOFTMAX_FILE
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            vocab = json.loads((f.metadata() or {})["vocab"])
        return load_file(str(path)), vocab
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise InputError(f"{path}: unreadable softmax ({e})", field="model") from e


def initial_weights(artifact, corpus: Corpus):
    """The function the trainer calls on its freshly built LM: MODEL's biLM weights, and the
    softmax rows MODEL ships (by token) or else the model's own token vectors (see the module
    docstring). Returns it and a description of the head, for the provenance."""
    shipped = _shipped_softmax(artifact.path)
    counts = _vocab_counts(corpus)
    described: list[str] = []

    def init(lm: LanguageModel) -> None:
        lm.bilm.load_state_dict(artifact.model.state_dict())
        sm = lm.softmax
        if not hasattr(sm, "weight"):  # only linear heads are initialised (adapt builds one)
            return
        v = sm.weight.shape[0]
        with torch.no_grad():
            vectors = lm.token_vectors(torch.arange(v))  # [V, P]: the character CNN's
            unit = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(1e-6)
            p = (counts[:v] + 1.0) / (counts[:v] + 1.0).sum()
            sm.bias.copy_(torch.from_numpy(np.log(p)).float())
            n_from, scale = 0, None
            if shipped is None:
                scale = _best_scale(lm, corpus, unit)
                sm.weight.copy_(unit * scale)
            else:
                state, vocab = shipped
                row = {w: i for i, w in enumerate(vocab)}
                for i, w in enumerate(corpus.vocab[:v]):
                    j = row.get(w)
                    if j is not None:
                        sm.weight[i] = state["weight"][j]
                        sm.bias[i] = state["bias"][j]
                        n_from += 1
        if n_from:
            rest = "; the others from token vectors" if n_from < v else ""
            described.append(f"MODEL's softmax ({n_from} of {v} rows{rest})")
        elif scale == 0:
            described.append(
                f"initialised from the model's token vectors at row norm 0, i.e. {UNIGRAM} "
                f"(log unigram bias alone: no norm in {SCALES} beat it on {SCALE_SENTENCES} "
                "training sentences)"
            )
        else:
            described.append(
                f"initialised from the model's token vectors (row norm {scale:g}, the best of "
                f"{SCALES} on {SCALE_SENTENCES} training sentences) + log unigram bias"
            )

    return init, described


SCALES = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # row norms tried for a tied head
UNIGRAM = "the unigram model"  # how the head is named when row norm 0 won
SCALE_SENTENCES = 64  # training sentences the row norm is chosen on


def _best_scale(lm: LanguageModel, corpus: Corpus, unit: torch.Tensor) -> float:
    """The row norm that gives a tied head (unit token vectors) the lowest perplexity on a
    few training sentences: a trained biLM's top layer and its character vectors live at
    their own scales, and raw vectors give logits in the hundreds (perplexity ~1e39 on
    models/default). 0 is the unigram model, so the head starts no worse than that."""
    train = corpus.split("train")
    sents = [np.asarray(train.sentence(i)) for i in range(min(len(train), SCALE_SENTENCES))]
    was = lm.training
    best = (math.inf, 0.0)
    for scale in SCALES:
        lm.softmax.weight.copy_(unit * scale)
        ev = perplexity(lm, corpus, sents, torch.device("cpu"), "fp32")
        ppl = ev.get("avg_ppl", ev["forward_ppl"])
        if math.isfinite(ppl) and ppl < best[0]:
            best = (ppl, scale)
    lm.train(was)
    return best[1]


def _forgetting_sentences(model_dir: Path, corpus: Corpus, opts: AdaptOptions):
    path = Path(opts.forgetting_text) if opts.forgetting_text else model_dir / HELDOUT_FILE
    if not path.is_file():
        if opts.forgetting_text:
            raise InputError(f"--forgetting-text {path}: no such file", field="forgetting_text")
        return None, None
    sents, extra = corpus.encode_file(path)
    return sents, extra


def _ppl(lm: LanguageModel, corpus: Corpus, sents, extra, max_chars: int) -> dict[str, float]:
    if extra:
        lm.set_char_table(corpus.char_table(max_chars, extra))
    try:
        return perplexity(lm, corpus, sents, torch.device("cpu"), "fp32")
    finally:
        if extra:
            lm.set_char_table(corpus.char_table(max_chars))
        lm.train()


def adapt(
    model_dir: str | Path,
    corpus_paths: list[str],
    out_dir: str | Path,
    options: AdaptOptions | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
    hand_on_signals: bool = True,
    log=print,
) -> AdaptResult:
    """Adapt MODEL to CORPUS and write NEW_MODEL (see the module docstring). ``resume``:
    continue the work folder's run; ``overwrite`` (the CLI's ``--overwrite`` / ``--force``):
    start it over and replace NEW_MODEL; ``stop_after``: stop (checkpointed, not exported)
    after N steps in this call. Bad input raises ``InputError`` before any training; a
    write that fails (a full disk) raises ``AdaptWriteFailed``, and ``resume`` continues."""
    opts = options or AdaptOptions()
    model_dir, out = Path(model_dir), Path(out_dir)
    if not corpus_paths:
        raise InputError("no corpus given: name one or more text files or folders", field="corpus")
    if out.exists() and any(out.iterdir()) and not (overwrite or resume):
        raise InputError(
            f"--out {out} exists and is not empty; pass --overwrite to replace it", field="out"
        )
    if out.resolve() == model_dir.resolve():
        raise InputError("--out must differ from MODEL (MODEL is read while training)", field="out")
    artifact, tokenizer = read_model(model_dir)
    set_threads(opts.threads or None)
    work = work_dir_for(out, opts)
    record = work / ADAPT_FILE
    if resume and not record.is_file():
        raise InputError(f"--resume: {work} holds no adaptation to continue", field="resume")
    if not resume and not overwrite and record.is_file():
        raise InputError(
            f"{work} already holds an adaptation; pass --resume to continue it, or "
            "--overwrite to start it over",
            field="work_dir",
        )
    saved = read_record(record) if resume else None  # before any work: a damaged one stops here
    t0 = time.time()
    corpus_dir = work / "corpus"
    prepare(
        list(corpus_paths),
        corpus_dir,
        _prepare_options(model_dir, tokenizer, opts),
        force=not resume,
        progress=opts.progress,
        log=log,
    )
    corpus = Corpus(corpus_dir)
    _check_corpus(corpus, list(corpus_paths))
    cfg = train_config_for(artifact.config, corpus_dir, opts)
    init, described = initial_weights(artifact, corpus)
    trainer = Trainer(
        cfg,
        work / "run",
        resume=resume,
        force=not resume,
        hand_on_signals=hand_on_signals,
        init=init,
        remedies=ADAPT_REMEDIES,
        log=log,
    )
    forget, extra = _forgetting_sentences(model_dir, corpus, opts)
    max_chars = cfg.model.max_chars_per_token
    if saved is not None:
        before = saved
    else:
        heldout = trainer.evaluate()
        trainer.model.train()
        before = {
            "model": str(model_dir),
            "model_version": artifact.version,
            "corpus": [str(p) for p in corpus_paths],
            "options": opts.model_dump(),
            "softmax": described[0] if described else "built",
            "heldout_before": heldout,
            "forgetting_before": _ppl(trainer.model, corpus, forget, extra, max_chars)
            if forget
            else None,
            "prepare_seconds": round(time.time() - t0, 1),
        }
        with _disk(f"write {record}", None, work):
            write_json(record, json_safe(before))
        log(
            _figures("before", before["heldout_before"], before["forgetting_before"])
            + _head_note(before["softmax"])
        )
    with _disk(f"write in {work / 'run'}", trainer, work):
        res = trainer.fit(stop_after=stop_after)
    stopped = res["stopped"]
    kind = "finished" if stopped == "done" else "max_minutes" if stopped == "time limit" else ""
    result = AdaptResult(
        out=str(out),
        version="",
        work_dir=str(work),
        step=res["step"],
        stopped=stopped,
        seconds=round(trainer.elapsed, 1),
        softmax=before["softmax"],
        heldout_before=before["heldout_before"],
        heldout_after=None,
        forgetting_before=before.get("forgetting_before"),
        exported=bool(kind),
    )
    if not kind:  # a signal or stop_after: checkpointed; --resume continues
        log(f"adapt: stopped at step {res['step']} ({stopped}); not exported; --resume continues")
        return result
    if forget:
        trainer.model.eval()
        result.forgetting_after = _ppl(trainer.model, corpus, forget, extra, max_chars)
    provenance = {
        "adapt": json_safe(
            {
                "from": {
                    "model": artifact.path.name,
                    "version": artifact.version,
                    "provenance_trainer": artifact.provenance.get("trainer"),
                },
                "softmax": result.softmax,
                "heldout_before": result.heldout_before,
                "forgetting_before": result.forgetting_before,
                "forgetting_after": result.forgetting_after,
                "forgetting_text": Path(opts.forgetting_text).name
                if opts.forgetting_text
                else (HELDOUT_FILE if result.forgetting_before else None),
                "steps": result.step,
                "seconds": result.seconds,
                "stopped": stopped,
                "options": opts.model_dump(exclude={"work_dir", "progress", "forgetting_text"}),
            }
        )
    }
    tasks = kept_tasks(artifact)
    with _disk(f"write {out}", trainer, work):
        exported = export(
            work / "run",
            out,
            overwrite=True,
            progress=opts.progress,
            provenance_extra=provenance,
            tasks=tasks,
        )
        _ship_softmax(trainer.model, corpus, out)
        if opts.ship_heldout:
            write_text(out / HELDOUT_FILE, (corpus_dir / "sentences.heldout.txt").read_text())
    result.version = exported["version"]
    result.heldout_after = exported["heldout"]
    result.extra["tasks"] = sorted(tasks)
    log(_figures("after", result.heldout_after, result.forgetting_after))
    if tasks:
        log(
            f"kept MODEL's tasks {', '.join(sorted(tasks))} (mixes learned on {artifact.name}; "
            "`elmo-pretrain probe --store` re-learns one on the adapted layers)"
        )
    log(
        f"wrote {out} (version {result.version}); {result.step} steps in {result.seconds / 60:.1f} min"
    )
    return result


def read_record(record: Path) -> dict[str, Any]:
    """The work folder's ``adapt.json`` (the start and the "before" figures), or one line
    saying it is damaged and how to start over."""
    try:
        rec = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        rec, why = None, (str(e).splitlines() or [type(e).__name__])[0]
    else:
        missing = (
            [k for k in ("softmax", "heldout_before") if k not in rec]
            if isinstance(rec, dict)
            else None
        )
        why = (
            "not a JSON object"
            if missing is None
            else f"no {', '.join(missing)}"
            if missing
            else ""
        )
    if why:
        raise InputError(
            f"--resume: {record} is damaged ({why}); --force (or --overwrite) starts the "
            "adaptation over",
            field="resume",
        )
    return rec


def kept_tasks(artifact: Artifact) -> dict[str, MixSpec]:
    """MODEL's task mixes that still fit NEW_MODEL (the same layers: always, as adapt keeps
    the shape), so a request's ``"task": "pos"`` goes on working; each says where it was
    learned (``meta.learned_on``)."""
    n_layers = artifact.config.n_output_layers
    kept: dict[str, MixSpec] = {}
    for name, spec in artifact.tasks.items():
        try:
            spec.validate(n_layers, name)
        except ElmoServiceError:
            continue  # cannot happen for a shape-preserving adapt; never ship a broken task
        meta = {**spec.meta, "learned_on": {"model": artifact.name, "version": artifact.version}}
        kept[name] = MixSpec.from_dict({**spec.to_dict(), "meta": meta})
    return kept


@contextlib.contextmanager
def _disk(what: str, trainer: Trainer | None, work: Path):
    """A write that fails (a full disk, a quota, an I/O error) as one line: what was being
    written, why, and what survives for ``--resume``. A missing or forbidden path is the
    CLI's one line already (``PATH_ERRORS``)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, PATH_ERRORS):
            raise
        why = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            why = f"{why}: free some space"
        target = f" ({e.filename})" if e.filename else ""
        kept = f"; {trainer.last_good()}" if trainer is not None else ""
        raise AdaptWriteFailed(
            f"could not {what}{target} ({why}){kept}; run the same command with --resume to "
            f"go on (work folder {work})",
            field="out",
        ) from e


def _ship_softmax(lm: LanguageModel, corpus: Corpus, out: Path) -> None:
    """NEW_MODEL/softmax.safetensors: the head's rows keyed by token (the next adapt's start).
    Beside the artifact's files like tasks/, so not part of its version."""
    sm = lm.softmax
    if not hasattr(sm, "weight"):
        return
    v = sm.weight.shape[0]
    state = {
        "weight": sm.weight.detach().float().cpu().contiguous(),
        "bias": sm.bias.detach().float().cpu().contiguous(),
    }
    with atomic_path(out / SOFTMAX_FILE) as tmp:
        save_file(state, str(tmp), metadata={"vocab": json.dumps(corpus.vocab[:v])})


def _head_note(softmax: str) -> str:
    """What the "before" figure measures when MODEL ships no softmax: the head's start."""
    if UNIGRAM in softmax:
        return (
            " (the unigram model: MODEL ships no softmax and its token vectors did not beat "
            "log-frequencies, so this is not MODEL's own perplexity)"
        )
    if softmax.startswith("initialised"):
        return " (with a head built from MODEL's token vectors: MODEL ships no softmax)"
    return ""


def _figures(when: str, heldout: dict | None, forgetting: dict | None) -> str:
    def ppl(ev):
        x = ev.get("avg_ppl", ev.get("forward_ppl")) if ev else None
        return "n/a" if x is None else f"{x:.2f}" if math.isfinite(x) else "inf"

    text = f"held-out perplexity {when}: {ppl(heldout)}"
    if forgetting:
        text += f"; on the model's original held-out text: {ppl(forgetting)}"
    return text
