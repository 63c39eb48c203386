"""Document mode (``Embedder.embed_document``, ``elmo_service/document.py``): chunked, the
LSTM state handed from chunk to chunk, equal to one unchunked pass over the whole text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from elmo_service import document
from elmo_service.artifact import save_artifact
from elmo_service.bilm.kernels.select import TorchBiLM
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError, LimitError
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import generated_text, tiny_model, train_sentencepiece
from tests.support.determinism import bound

CHUNKS = (1, 7, 64, 512)
# ~700 pieces of a sub-word-heavy vocabulary, several lines (newlines inside the document)
TEXT = generated_text(n_lines=40, seed=3)
NORM = MixSpec([0.3, 1.0, -0.5], gamma=1.7, layer_norm=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("doc")
    save_artifact(tiny_model(), train_sentencepiece(d), d / "m", tasks={"norm": NORM})
    return d / "m"


@pytest.fixture(scope="module")
def embedder(model_dir: Path) -> Embedder:
    return Embedder.load(model_dir)


@pytest.fixture(scope="module")
def one_pass(model_dir: Path) -> Embedder:
    return Embedder.load(model_dir, max_sentence_tokens=100_000)


def joined(parts) -> tuple[list, np.ndarray, np.ndarray | None]:
    tokens = [t for p in parts for t in p.tokens]
    layers = np.concatenate([p.layers for p in parts], axis=1)
    mix = None if parts[0].mix is None else np.concatenate([p.mix for p in parts], axis=0)
    return tokens, layers, mix


def assert_close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    err = float(np.abs(got - ref).max())
    assert err <= bound(ref), (err, bound(ref))


def test_the_document_is_long_enough_to_chunk(one_pass: Embedder) -> None:
    n = len(one_pass.tokenizer(TEXT))
    assert n > 2 * max(CHUNKS[:3]) and n > 512, n


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_equal_one_pass_over_the_whole_text(
    embedder: Embedder, one_pass: Embedder, chunk: int
) -> None:
    ref = one_pass.embed([TEXT])[0]
    # the same text in a batch with other sentences: another kernel path, the same vectors
    batched = one_pass.embed(["Extraordinary bridges", TEXT, "a"])[1]
    parts = list(embedder.embed_document(TEXT, chunk_tokens=chunk))
    n = len(ref.tokens)
    assert len(parts) == -(-n // chunk)
    assert all(len(p.tokens) == p.layers.shape[1] <= chunk for p in parts)
    tokens, layers, _ = joined(parts)
    assert tokens == ref.tokens  # offsets into the document, word indices of the whole text
    assert layers.shape == ref.layers.shape
    assert_close(layers, ref.layers)
    assert_close(layers, batched.layers)


def test_chunks_are_not_independent_sentences(embedder: Embedder) -> None:
    """The state crosses chunks: chunk 2 differs from the same tokens embedded alone."""
    parts = list(embedder.embed_document(TEXT, chunk_tokens=64, granularity="word"))
    span = TEXT[parts[1].tokens[0].start : parts[1].tokens[-1].end]
    alone = embedder.embed([span], granularity="word")[0].layers
    assert alone.shape == parts[1].layers.shape
    assert float(np.abs(alone[1:] - parts[1].layers[1:]).max()) > 1e-3
    # layer 0 is the context-free token vectors: the same
    assert_close(parts[1].layers[0], alone[0])


@pytest.mark.parametrize("chunk", (7, 64))
def test_two_threads_run_the_directions_on_the_two_workers(
    embedder: Embedder, one_pass: Embedder, torch_threads, chunk: int
) -> None:
    """With 2 torch threads the directions run on the direction workers, a round ahead of
    the rows written: the same vectors."""
    torch_threads(2)
    ref = one_pass.embed([TEXT], mix="norm")[0]
    tokens, layers, mix = joined(list(embedder.embed_document(TEXT, chunk, mix="norm")))
    assert tokens == ref.tokens
    assert_close(layers, ref.layers)
    assert_close(mix, ref.mix)


@pytest.mark.parametrize("chunk", (1, 7, 64))
def test_word_granularity_and_a_layer_normed_mix(
    embedder: Embedder, one_pass: Embedder, chunk: int
) -> None:
    ref = one_pass.embed([TEXT], granularity="word", mix="norm")[0]
    parts = list(embedder.embed_document(TEXT, chunk, granularity="word", mix="norm"))
    tokens, layers, mix = joined(parts)
    assert [(t.start, t.end, t.word) for t in tokens] == [
        (t.start, t.end, t.word) for t in ref.tokens
    ]
    assert [t.text for t in tokens] == [t.text for t in ref.tokens]
    words = [t.word for t in tokens]
    assert len(set(words)) == len(words)  # no word split across two chunks
    assert_close(layers, ref.layers)
    assert_close(mix, ref.mix)


def test_pre_tokenized_words(embedder: Embedder, one_pass: Embedder) -> None:
    words = TEXT.split()
    ref = one_pass.embed([words])[0]
    tokens, layers, _ = joined(list(embedder.embed_document(words, chunk_tokens=7)))
    assert tokens == ref.tokens
    assert_close(layers, ref.layers)


def test_segmented_tokenization_and_the_spill_file(
    embedder: Embedder, one_pass: Embedder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A long document: tokenized in segments cut at whitespace (the same tokens), its
    rows spilled to a temporary file (the same vectors), removed at the end."""
    monkeypatch.setattr(document, "SEGMENT_CHARS", 37)
    monkeypatch.setattr(document, "SPILL_IN_MEMORY_BYTES", 0)
    ref = one_pass.embed([TEXT])[0]
    gen = embedder.embed_document(TEXT, chunk_tokens=64, spill_dir=tmp_path)
    first = next(gen)
    rest = list(gen)
    tokens, layers, _ = joined([first, *rest])
    assert tokens == ref.tokens
    assert_close(layers, ref.layers)
    assert list(tmp_path.iterdir()) == []  # unlinked from the start: nothing left behind


def test_torch_kernel_path(model_dir: Path) -> None:
    """The model's own layers (any device or precision), state carried the same way."""
    e = Embedder.load(model_dir)
    ref_e = Embedder.load(model_dir, max_sentence_tokens=100_000)
    e.runner.kernel = TorchBiLM(e.model)
    ref_e.runner.kernel = TorchBiLM(ref_e.model)
    ref = ref_e.embed([TEXT])[0]
    _, layers, _ = joined(list(e.embed_document(TEXT, chunk_tokens=7)))
    assert_close(layers, ref.layers)


def test_int8_weights(model_dir: Path) -> None:
    e = Embedder.load(model_dir, weights="int8")
    ref = Embedder.load(model_dir, weights="int8", max_sentence_tokens=100_000).embed([TEXT])[0]
    _, layers, _ = joined(list(e.embed_document(TEXT, chunk_tokens=64)))
    assert_close(layers, ref.layers)


def test_a_short_document_and_one_token(embedder: Embedder, one_pass: Embedder) -> None:
    for text in ("a", "Extraordinary bridges"):
        ref = one_pass.embed([text])[0]
        tokens, layers, _ = joined(list(embedder.embed_document(text, chunk_tokens=1)))
        assert tokens == ref.tokens
        assert_close(layers, ref.layers)


@pytest.mark.parametrize(
    ("doc", "options", "error", "field"),
    [
        ("", {}, InputError, "document"),
        ("  \n\t ", {}, InputError, "document"),
        ("x" * (1 << 20), {}, InputError, "document"),
        ("ok " + "y" * 1001 + " ok", {}, InputError, "document"),
        (42, {}, InputError, "document"),
        (["fine", " "], {}, InputError, "document[1]"),
        (TEXT, {"max_tokens": 10}, LimitError, "document"),
        (TEXT, {"chunk_tokens": 0}, InputError, "chunk_tokens"),
        (TEXT, {"mix": "nope"}, InputError, "mix"),
        (TEXT, {"granularity": "page"}, InputError, "granularity"),
    ],
)
def test_bad_input_is_refused_before_the_first_chunk(
    embedder: Embedder, doc, options: dict, error: type, field: str
) -> None:
    with pytest.raises(error) as e:
        embedder.embed_document(doc, **options)  # not iterated: refused at the call
    assert e.value.field == field
    assert "\n" not in str(e.value)


# -- several documents advanced together (the server's batched rounds) ----------------

DOCS = (TEXT, "Extraordinary bridges", TEXT[: len(TEXT) // 3], "a", TEXT[len(TEXT) // 2 :])


def run_together(emb: Embedder, texts, chunk: int, spec) -> list[tuple]:
    """Every document advanced together while it has rounds left (documents of different
    lengths finish at different rounds), then each one's answer."""
    runs = [
        document.DocumentRun(
            emb, document.tokenize_document(emb.tokenizer, t, max_tokens=None), spec, chunk
        )
        for t in texts
    ]
    try:
        assert [r.tokens for r in runs] == [len(r.doc) for r in runs]
        while not all(r.done for r in runs):
            document.advance([r for r in runs if not r.done])
        return [joined(list(r.answer())) for r in runs]
    finally:
        for r in runs:
            r.close()
            r.close()  # idempotent
            assert r.spill_bytes == 0


@pytest.mark.parametrize("chunk", (1, 7, 64))
@pytest.mark.parametrize("weights", ("fp32", "int8"))
def test_documents_advanced_together_equal_each_alone_and_one_pass(
    model_dir: Path, torch_threads, chunk: int, weights: str
) -> None:
    torch_threads(2)  # the directions on the two workers, as a server runs them
    emb = Embedder.load(model_dir, weights=weights)
    ref_e = Embedder.load(model_dir, weights=weights, max_sentence_tokens=100_000)
    spec = emb.output_spec("norm")
    together = run_together(emb, DOCS, chunk, spec)
    for text, (tokens, layers, mix) in zip(DOCS, together, strict=True):
        alone = joined(list(emb.embed_document(text, chunk, mix="norm")))
        ref = ref_e.embed([text], mix="norm")[0]
        assert tokens == alone[0] == ref.tokens
        assert_close(layers, alone[1])
        assert_close(layers, ref.layers)
        assert_close(mix, ref.mix)


def test_a_run_steps_a_round_at_a_time(embedder: Embedder) -> None:
    doc = document.tokenize_document(embedder.tokenizer, TEXT, max_tokens=None)
    run = document.DocumentRun(embedder, doc, embedder.output_spec(None), 64)
    assert run.rounds == -(-(len(doc) + 2) // 64) and not run.done
    assert run.spill_bytes > 0
    with pytest.raises(ValueError, match="not done"):
        next(run.answer())
    for _ in range(run.rounds):
        assert not run.done
        document.advance([run])
    assert run.done
    with pytest.raises(ValueError, match="no round left"):
        document.advance([run])
    assert sum(c.layers.shape[1] for c in run.answer()) == len(doc)
    run.close()
    with pytest.raises(ValueError, match="closed"):
        next(run.answer())


@pytest.mark.parametrize("round_tokens", (7, 64, 10_000))
def test_rounds_shorter_than_a_chunk_keep_the_chunks_and_the_vectors(
    embedder: Embedder, one_pass: Embedder, round_tokens: int
) -> None:
    """The server's rounds (pass 1's unit) are shorter than its answer chunks: the answer
    keeps ``chunk_tokens`` and one pass's vectors, whatever the round (at most a chunk)."""
    doc = document.tokenize_document(embedder.tokenizer, TEXT, max_tokens=None)
    runs = [
        document.DocumentRun(embedder, doc, embedder.output_spec("norm"), 64, round_tokens=r)
        for r in (round_tokens, None)
    ]
    assert runs[0].round_tokens == min(round_tokens, 64)
    assert runs[0].rounds == -(-(len(doc) + 2) // min(round_tokens, 64))
    while not runs[0].done:
        document.advance([runs[0]] if runs[1].done else runs)  # together, then alone
    got, plain = (list(r.answer()) for r in runs)
    assert [len(c.tokens) for c in got] == [len(c.tokens) for c in plain]
    assert all(len(c.tokens) <= 64 for c in got)
    ref = one_pass.embed([TEXT], mix="norm")[0]
    assert_close(joined(got)[1], ref.layers)
    assert_close(joined(got)[2], ref.mix)
    with pytest.raises(ValueError, match="round_tokens"):
        document.DocumentRun(embedder, doc, embedder.output_spec(None), 64, round_tokens=0)
    for r in runs:
        r.close()


def test_the_torch_kernel_advances_documents_together(model_dir: Path) -> None:
    e = Embedder.load(model_dir)
    ref_e = Embedder.load(model_dir, max_sentence_tokens=100_000)
    e.runner.kernel = TorchBiLM(e.model)
    together = run_together(e, DOCS[:3], 7, e.output_spec(None))
    for text, (_, layers, _) in zip(DOCS[:3], together, strict=True):
        assert_close(layers, ref_e.embed([text])[0].layers)


@pytest.mark.parametrize("in_order", (False, True))
@pytest.mark.parametrize("at_once", (1, 2, 64))
def test_advance_all_keeps_at_most_at_once_and_equals_each_alone(
    embedder: Embedder, monkeypatch, at_once: int, in_order: bool
) -> None:
    """``advance_all`` (embed-file's documents): runs taken as room frees up, never more than
    ``at_once`` in one step, each yielded once when done with its own vectors, and closed."""
    spec = embedder.output_spec(None)
    steps: list[int] = []
    real = document.advance
    monkeypatch.setattr(document, "advance", lambda runs: (steps.append(len(runs)), real(runs)))
    made: list[document.DocumentRun] = []

    def runs():
        for t in DOCS:
            doc = document.tokenize_document(embedder.tokenizer, t, max_tokens=None)
            made.append(document.DocumentRun(embedder, doc, spec, 7))
            yield made[-1]

    got = {}
    for i, run in document.advance_all(runs(), at_once, in_order=in_order):
        got[i] = np.concatenate([c.layers for c in run.answer()], axis=1)
    assert sorted(got) == list(range(len(DOCS))) and max(steps) <= min(at_once, len(DOCS))
    assert max(steps) == min(at_once, len(DOCS)) or in_order  # in order, the first may lag
    if in_order:
        assert list(got) == list(range(len(DOCS)))
    else:  # as they finish: the short ones before the long first one
        assert at_once == 1 or list(got) != list(range(len(DOCS)))
    assert all(r.spill_bytes == 0 for r in made)  # every run closed
    for i, t in enumerate(DOCS):
        assert_close(got[i], joined(list(embedder.embed_document(t, 7)))[1])


def test_advance_all_closes_every_run_when_the_caller_stops(embedder: Embedder) -> None:
    spec = embedder.output_spec(None)
    made = [
        document.DocumentRun(
            embedder, document.tokenize_document(embedder.tokenizer, t, max_tokens=None), spec, 7
        )
        for t in DOCS
    ]
    walk = document.advance_all(iter(made), 3)
    next(walk)
    walk.close()  # e.g. the caller found a non-finite vector and raised
    assert all(r.spill_bytes == 0 for r in made[:3])
    with pytest.raises(InputError, match="documents_at_once"):
        next(document.advance_all(iter(made[3:]), 0))
    for r in made:
        r.close()
