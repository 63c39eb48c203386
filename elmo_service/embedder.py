"""Sentences -> per-layer contextual vectors, fast and reproducible.

``Embedder.embed`` tokenizes, then ``embed_tokens`` does the work:

1. sentences are sorted by length and cut into batches under a token budget
   (padded cost ``n * max_len``, ``elmo_service/bilm/runner.py`` ``plan_batches``), so padding stays
   small; each batch is one ``run_batch`` call (the server's batcher plans
   with the same function and calls ``run_batch`` directly);
2. each batch's distinct tokens are looked up in the token-vector cache (the
   character CNN is most of the FLOPs of released-size models); misses run
   through the CNN once per distinct token;
3. the biLSTM runs on the assembled ``[B, T, P]`` token vectors, from a zero
   state, so a sentence's vectors depend on its batch mates only through the order of
   float32 sums: within 1e-5 x its largest value (docs/reliability.md#determinism).

Both halves run in the kernel chosen once at construction and logged
(``elmo_service/bilm/kernels``): on the CPU in fp32, ``CpuBiLM`` (native kernels;
``weights="int8"`` / ``"bf16"``, opt-in, round the weights: speed in
``docs/bench-embedder.md``, error as :attr:`Embedder.certificate`); otherwise
the model's own torch code.

Outputs are float32 numpy arrays ``[L+1, T, D]`` per sentence, markers removed; words,
mixes and the rest of what a caller asks are ``elmo_service/outputs.py``'s, the same for the
library, the CLI, ``embed-bulk`` and the HTTP API.

AllenNLP's ``ElmoEmbedder`` names are here too (``embed_sentence``, ``embed_sentences``,
``embed_batch``, ``embed_file``), answering :class:`EmbeddedSentence` (its ``layers`` is
what ``ElmoEmbedder`` returned).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from elmo_service.artifact import Artifact, default_model_dir, load_artifact
from elmo_service.bilm.char_ids import bos_ids, eos_ids, token_ids
from elmo_service.bilm.config import DEFAULT_TOKEN_CACHE_SIZE
from elmo_service.bilm.kernels.packed import check_weights_mode
from elmo_service.bilm.runner import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_SENTENCES,
    BatchBudget,
    Runner,
    plan_batches,
)
from elmo_service.embed_file import chunks
from elmo_service.errors import ConfigError, InputError, LimitError, UnknownTask
from elmo_service.outputs import OutputSpec, positions, render, resolve_output
from elmo_service.runtime import pick_device, resolve_precision, set_threads
from elmo_service.scalar_mix import MixSpec, apply_mix  # noqa: F401 - re-exported
from elmo_service.values import (  # shared with the client
    EmbeddedSentence,
    Token,
    invalid_text,
    words_of,
)

__all__ = ["EmbeddedSentence", "Embedder", "apply_mix", "words_of"]

Sentence = str | Sequence[str]
# how an error names sentence i (word j) of the caller's input: "line 7 of a.txt, word 2"
Where = Callable[[int, "int | None"], str]
# what warm_up embeds: a batch, then one sentence alone (another path of the CPU kernel)
WARMUP_SENTENCES = (
    ("Hello", "world", "."),
    ("The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "near", "the", "river"),
)

log = logging.getLogger(__name__)


def _where(field: str, i: int, j: int | None = None) -> str:
    """How an error names sentence ``i`` (word ``j``): "sentence 3, word 1" for the library's
    own ``sentences``, "input[3][1]" where the caller names another field."""
    if field == "sentences":
        return f"sentence {i}" if j is None else f"sentence {i}, word {j}"
    return f"{field}[{i}]" if j is None else f"{field}[{i}][{j}]"


def _check_words_kept(
    words: Sequence[str], toks: list[Token], i: int, field: str, where: Where
) -> None:
    """Pre-tokenized input: every word must keep at least one token, or the output would
    silently hold fewer words than the caller gave (and misalign with their labels)."""
    kept = {t.word for t in toks}
    for j, w in enumerate(words):
        if not w.strip():
            raise InputError(
                f"{where(i, j)} is empty or only whitespace: a pre-tokenized word "
                "needs a character to embed",
                field=f"{field}[{i}][{j}]",
                index=i,
                word=j,
            )
        if j not in kept:
            raise InputError(
                f"{where(i, j)} ({w!r}) has no character the tokenizer keeps",
                field=f"{field}[{i}][{j}]",
                index=i,
                word=j,
            )


class Embedder:
    """Load once, embed many times. Thread-safe: one forward pass at a time.

    # Parameters

    artifact : `Artifact`
        The model, its tokenizer and tasks (``load_artifact``; :meth:`load` reads one).
    device : `str`, optional (default = `"auto"`)
        ``"cpu"``, ``"cuda[:n]"``, or ``"auto"`` (CUDA when available).
    precision : `str`, optional (default = `"fp32"`)
        ``"fp32"``, ``"bf16"``/``"fp16"`` autocast, or ``"auto"`` (bf16 where native).
    token_cache_size : `int`, optional
        Token vectors (the character CNN's output) kept in an LRU; 0 turns it off.
    batch_tokens : `int`, optional
        The padded-token budget of one model call (``len(batch) * longest``).
    max_batch_sentences : `int`, optional
        The most sentences in one model call.
    max_sentence_tokens : `int`, optional (default = the model's own limit)
        Longer sentences are refused with a ``LimitError`` naming them.
    compile : `bool`, optional (default = `False`)
        ``torch.compile`` the biLSTM (then the torch kernel runs, on any device).
    weights : `str`, optional (default = `"fp32"`, exact)
        ``"int8"`` / ``"bf16"`` (CPU, fp32 precision, no compile; opt-in): the
        weights rounded once and streamed compact where a step is bound by reading
        them (about 2x fp32 for one sentence of a big model); :attr:`certificate`
        is the error against fp32 measured on this model. Its replicas never share
        cached vectors with fp32 ones (``cache_key_prefix``).

    The kernel (``elmo_service/bilm/kernels``) is chosen here, once, from the device,
    precision, weights and compile, and logged; :attr:`kernel_name` says which.
    """

    def __init__(
        self,
        artifact: Artifact,
        *,
        device: str = "auto",
        precision: str = "fp32",
        token_cache_size: int = DEFAULT_TOKEN_CACHE_SIZE,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        max_batch_sentences: int = DEFAULT_MAX_BATCH_SENTENCES,
        max_sentence_tokens: int | None = None,
        compile: bool = False,
        weights: str = "fp32",
    ) -> None:
        self.budget = BatchBudget(batch_tokens, max_batch_sentences)
        check_weights_mode(weights)
        self.artifact = artifact
        self.device = pick_device(device)
        if weights != "fp32" and precision == "auto":
            precision = "fp32"  # the int8 kernels accumulate in fp32; auto must not pick bf16
        self.precision = resolve_precision(self.device, precision)
        if weights != "fp32" and (self.device.type != "cpu" or self.precision != "fp32" or compile):
            raise ConfigError(
                f"weights={weights!r} runs on the CPU in fp32 without compile "
                f"(got device {self.device.type}, precision {self.precision}, compile {compile})",
                field="weights",
            )
        self.weights = weights
        self.model = artifact.model.to(self.device).eval()
        self.tokenizer = artifact.tokenizer
        self.cfg = artifact.config
        # token texts -> character ids: the model's own lexicon (ELMoForManyLangs), else bytes
        lexicon = getattr(self.tokenizer, "lexicon", None)
        ids = (
            (token_ids, bos_ids, eos_ids)
            if lexicon is None
            else (lexicon.token_ids, lexicon.bos_ids, lexicon.eos_ids)
        )
        self.max_sentence_tokens = max_sentence_tokens or self.cfg.max_sentence_tokens
        # the kernel (chosen once), the token-vector cache and the one model lock
        self.runner = Runner(
            self.model,
            device=self.device,
            precision=self.precision,
            weights=weights,
            compile=compile,
            token_cache_size=token_cache_size,
            char_ids=ids,
        )
        self._certificate: dict | None = None
        log.info("kernel: %s", self.kernel.name)

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        threads: int | None = None,
        device: str = "auto",
        **kwargs,
    ) -> Embedder:
        """Read an artifact folder; none given: the model ``elmo-service serve`` serves by
        default (the bundled one, wherever the process runs). ``threads``: set torch's thread
        count; left alone when not given (``configure_process``, or the caller, decides it)."""
        if threads is not None:
            set_threads(threads)
        return cls(
            load_artifact(path or default_model_dir(), device="cpu"), device=device, **kwargs
        )

    def warm_up(self) -> None:
        """Compile what the chosen kernel compiles ahead of time, and run a batch and a
        sentence alone through it, so that no request pays for a first call."""
        self.prepare()
        self.embed_tokens(WARMUP_SENTENCES)
        self.embed_tokens(WARMUP_SENTENCES[:1])

    def prepare(self) -> None:
        """What a load measures once, not on a request: the kernel's warm-up (compile; for
        fp32 the per-machine route, ``kernels/calibrate.py``) and a fast path's certificate."""
        self.kernel.warm_up()
        self.certificate  # noqa: B018 - measured and kept

    @property
    def speed_path(self) -> str:
        """The path the model runs: the kernel and its weights (``"cpu-native fp32"``, exact;
        ``"cpu-native int8"`` / ``"cpu-native bf16"``, certified; ``"torch"``...)."""
        return self.kernel.name

    @property
    def certificate(self) -> dict | None:
        """A rounded-weights path's certified error against exact fp32, per sentence
        (``elmo_service/bilm/kernels/certificate.py``): ``max_rel_diff`` (any value,
        relative to the sentence's largest) and ``rms_rel_diff`` bounds, the ``measured``
        worst and the ``margin``, the generated sentences and tokens it covers, the
        ``longest`` sentence covered, ``heldout``. Measured once per model, mode, kernel
        and machine (cached on disk). None for fp32 (exact: the reference itself)."""
        if self.weights == "fp32":
            return None
        if self._certificate is None:
            from elmo_service.bilm.kernels import certificate as cert_mod

            def measure():
                # the reference: the same model in exact fp32, built for this measure only
                ref = Embedder(self.artifact, device="cpu", weights="fp32", token_cache_size=0)
                limit = min(cert_mod.MAX_TOKENS, self.max_sentence_tokens)
                texts = [
                    [t.piece for t in self.tokenizer(s)][:limit]
                    for s in cert_mod.certificate_texts()
                ]
                return cert_mod.certify(
                    self.speed_path, self.weights, self.embed_tokens, ref.embed_tokens, texts
                )

            key = cert_mod.cache_key(self.model, self.weights, self.speed_path)
            self._certificate = cert_mod.cached(key, measure)
            log.info(
                "certificate of %s: max relative diff %.2e, rms %.2e per sentence",
                self.speed_path,
                self._certificate["max_rel_diff"],
                self._certificate["rms_rel_diff"],
            )
        return self._certificate

    # -- properties the service reports ---------------------------------
    @property
    def kernel(self):
        """The kernel the runner chose (``elmo_service/bilm/kernels``)."""
        return self.runner.kernel

    @property
    def lock(self):
        """The one lock of every model call (the runner's)."""
        return self.runner.lock

    @property
    def cache_hits(self) -> int:
        """Token-vector cache hits so far (the runner's)."""
        return self.runner.cache_hits

    @property
    def cache_misses(self) -> int:
        return self.runner.cache_misses

    @property
    def kernel_name(self) -> str:
        """Which kernel runs the model: ``"cpu-native fp32"``, ``"cpu-native int8"``, ``"torch"``..."""
        return self.kernel.name

    @property
    def version(self) -> str:
        return self.artifact.version

    @property
    def n_layers(self) -> int:
        return self.cfg.n_output_layers

    @property
    def dim(self) -> int:
        return self.cfg.output_dim

    @property
    def batch_tokens(self) -> int:
        return self.budget.tokens

    @property
    def max_batch_sentences(self) -> int:
        return self.budget.sentences

    @property
    def cache_key_prefix(self) -> str:
        """Model version + tokenizer + precision (+ weight mode unless fp32): a new model,
        or a bf16 or int8 replica beside an fp32 one, never reuses another's vectors."""
        mode = "" if self.weights == "fp32" else f":w-{self.weights}"
        return f"{self.version}:{self.tokenizer.fingerprint}:{self.precision}{mode}"

    # -- public API -------------------------------------------------------
    def tokenize(
        self,
        sentences: Iterable[Sentence],
        *,
        field: str = "sentences",
        where: Where | None = None,
        offset: int = 0,
    ) -> list[list[Token]]:
        """Tokens per sentence. Errors carry ``field[i]`` (the caller's name for the list:
        an HTTP route passes its request field) and the position (``index``, ``word``);
        their message names it with ``where(i, j)`` (default "sentence 3, word 1", or
        "input[3][1]" for another field): a file reader passes "line 7 of a.txt".
        ``offset``: the first sentence's place in the caller's whole input (``i`` counts
        from it), for callers that hand a long input over in chunks."""
        if where is None:
            where = lambda i, j: _where(field, i, j)  # noqa: E731
        out = []
        for i, s in enumerate(sentences, start=offset):
            if not isinstance(s, str) and not (
                isinstance(s, Sequence) and all(isinstance(w, str) for w in s)
            ):
                raise InputError(
                    f"{where(i, None)} must be a string or a list of strings",
                    field=f"{field}[{i}]",
                    index=i,
                )
            for j, text in enumerate([s] if isinstance(s, str) else s):
                why = invalid_text(text)
                if why is not None:
                    word = None if isinstance(s, str) else j
                    at = f"{field}[{i}]" if word is None else f"{field}[{i}][{j}]"
                    raise InputError(f"{where(i, word)} {why}", field=at, index=i, word=word)
            toks = self.tokenizer(s)
            if not isinstance(s, str):
                _check_words_kept(s, toks, i, field, where)
            if len(toks) > self.max_sentence_tokens:
                raise LimitError(
                    f"{where(i, None)} has {len(toks)} tokens; "
                    f"the limit is {self.max_sentence_tokens}",
                    field=f"{field}[{i}]",
                    index=i,
                )
            out.append(toks)
        return out

    def embed(
        self,
        sentences: Iterable[Sentence],
        *,
        granularity: str = "token",
        mix: MixSpec | str | None = None,
        where: Where | None = None,
        offset: int = 0,
    ) -> list[EmbeddedSentence]:
        """Embed strings (tokenized by the model's tokenizer) or token lists.

        ``granularity="word"`` averages each word's subword pieces (tokens then
        are words); ``mix`` (a :class:`MixSpec`, the name of a task stored with
        the model, or ``"default"``: that task when stored, else the average of all
        layers) also fills ``EmbeddedSentence.mix`` ``[T, D]``. The mix is taken over
        the model's tokens, then averaged per word, as on every surface
        (``elmo_service/outputs.py``). ``where``, ``offset``: how errors name a bad
        sentence (:meth:`tokenize`).
        """
        spec = self.output_spec(mix, granularity)
        sentences = list(sentences)
        token_lists = self.tokenize(sentences, where=where, offset=offset)
        layers = self.embed_tokens([[t.piece for t in toks] for toks in token_lists])
        return [
            self._answer(sent, toks, x, spec)
            for sent, toks, x in zip(sentences, token_lists, layers, strict=True)
        ]

    def output_spec(self, mix: MixSpec | str | None, granularity: str = "token") -> OutputSpec:
        """The library's answer: all layers, and the mix when one is named."""
        if mix is not None and not isinstance(mix, (MixSpec, str)):
            raise InputError("mix must be a MixSpec or a task name", field="mix")
        task = mix if isinstance(mix, str) else None
        inline = mix if isinstance(mix, MixSpec) else None
        try:
            return resolve_output(
                self.n_layers,
                self.artifact.tasks.get,
                self.artifact.tasks,
                output="both" if mix is not None else "layers",
                mix=inline,
                task=None if task == "default" else task,  # "default": the default policy
                granularity=granularity,
            )
        except UnknownTask as e:  # the library's argument is ``mix``
            raise UnknownTask(e.name, e.known, field="mix") from None

    @staticmethod
    def _answer(sent: Sentence, toks: list[Token], x: np.ndarray, spec: OutputSpec):
        layers, mixed = render(x, toks, spec)
        text = sent if isinstance(sent, str) else " ".join(sent)  # what the offsets point into
        if spec.granularity == "word":
            toks = positions(toks, spec, text)
        return EmbeddedSentence(toks, layers, mixed, text)

    # -- AllenNLP's ElmoEmbedder names ------------------------------------
    def embed_sentence(self, sentence: Sentence, **options) -> EmbeddedSentence:
        """One sentence (a string, or its tokens): ``.layers`` is ``[L+1, T, D]``, what
        ``ElmoEmbedder.embed_sentence`` returned. ``options``: as :meth:`embed`."""
        return self.embed([sentence], **options)[0]

    def embed_batch(self, batch: Sequence[Sentence], **options) -> list[EmbeddedSentence]:
        """A list of sentences, answered in order (batched under the token budget)."""
        return self.embed(batch, **options)

    def embed_sentences(
        self, sentences: Iterable[Sentence], batch_size: int = 64, **options
    ) -> Iterator[EmbeddedSentence]:
        """Lazily, in order: reads ``batch_size`` sentences at a time from any iterable
        (a file, a generator), so neither the input nor the answers are ever all held.
        Errors name the sentence by its place in the whole input."""
        if batch_size < 1:
            raise InputError("batch_size must be >= 1", field="batch_size")
        first = 0
        for batch in chunks(sentences, batch_size):
            yield from self.embed(batch, offset=first, **options)
            first += len(batch)

    def embed_file(self, input_file: str | Path, output_file: str | Path, **options) -> int:
        """Write ``embed-file``'s HDF5 layout (AllenNLP's ``elmo`` command's): dataset ``i``
        is line ``i``, plus ``sentence_to_index``. Returns the sentences written.
        ``options``: :func:`elmo_service.embed_file.write_hdf5`'s."""
        from elmo_service.embed_file import write_hdf5

        return write_hdf5(self, Path(input_file), Path(output_file), **options)

    def embed_document(
        self,
        document: Sentence,
        chunk_tokens: int | None = None,
        *,
        granularity: str = "token",
        mix: MixSpec | str | None = None,
        max_tokens: int | None = None,
        spill_dir: str | Path | None = None,
    ) -> Iterator[EmbeddedSentence]:
        """A whole document (text, or its words) as one sequence, chunk by chunk in order.

        The forward LSTMs read the whole document from a zero state at its start, the
        backward ones from a zero state at its end (one ``<S>`` and one ``</S>``); each
        value's tokens carry offsets into the document, and the chunks' ``layers``
        concatenated along the tokens are one pass over the whole text (what ``embed``
        gives with ``max_sentence_tokens`` large enough), at any ``chunk_tokens``
        (default ``document.DEFAULT_CHUNK_TOKENS``; word granularity never splits a word).
        Memory does not grow with the document; a long one spills to a temporary file
        in ``spill_dir`` (see ``elmo_service/document.py``, ``docs/documents.md``).
        ``granularity``, ``mix``: as :meth:`embed` (a layer norm uses the whole
        document's statistics). ``max_tokens``: refuse longer documents (LimitError).
        Bad input is refused here, before the first chunk.
        """
        from elmo_service.document import embed_document_chunks, tokenize_document

        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise InputError("chunk_tokens must be an integer >= 1", field="chunk_tokens")
        spec = self.output_spec(mix, granularity)
        doc = tokenize_document(self.tokenizer, document, max_tokens=max_tokens)
        chunks_ = embed_document_chunks(
            self, doc, spec, chunk_tokens, spill_dir=None if spill_dir is None else str(spill_dir)
        )
        return (EmbeddedSentence(c.tokens, c.layers, c.mix, doc.text) for c in chunks_)

    def embed_tokens(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Token texts -> ``[L+1, T, D]`` float32 per sentence, in input order.

        Plans batches under the budget, then runs each with :meth:`run_batch`.
        """
        out: list[np.ndarray | None] = [None] * len(sentences)
        for batch in self.plan_batches([len(s) for s in sentences]):
            for i, arr in zip(batch, self.run_batch([sentences[i] for i in batch]), strict=True):
                out[i] = arr
        return out  # type: ignore[return-value]

    def plan_batches(self, lengths: Sequence[int]) -> Iterator[list[int]]:
        """Indices sorted by length (longest first), cut under the token budget
        (``lengths`` without the sentence markers)."""
        yield from plan_batches([n + 2 for n in lengths], self.budget)

    def run_batch(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """One model call on exactly these token texts, as the caller planned them
        (the server's batcher): ``[L+1, T, D]`` float32 per sentence, in input order.
        A sentence's vectors depend on its batch mates only within the determinism bound
        (1e-5 x its largest value: the float32 sums' order)."""
        if not sentences:
            return []
        return self.runner.run_tokens(list(sentences))
