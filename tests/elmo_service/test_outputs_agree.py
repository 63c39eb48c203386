"""Every surface gives the same answer: the library, ``POST /v1/embed``,
``POST /v1/embeddings``, ``embed-file`` and ``embed-bulk`` over every combination of
output kind, layer subset, task mix (with and without layer norm, per direction or not),
inline mix, the default mix, granularity and pooling, on a sub-word-heavy model.

Each surface is checked against one textbook reference written here in float64 (the
order ``elmo_service/outputs.py`` documents: the mix over the model's token layers, then a
word's pieces averaged, then pooling), so they agree with each other within the
determinism bound (``tests/support/determinism.py``: 1e-5 x the largest magnitude, at
least 1e-5)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_cli.main import main
from elmo_service.artifact import save_artifact
from elmo_service.embedder import Embedder
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import tiny_model, train_sentencepiece
from tests.support.determinism import bound

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"authorization": "Bearer admin"}
# words a vocabulary of 80 pieces splits into many pieces
SENTENCES = [
    # ﬁ: sentencepiece's NFKC gives the model f, i (a token's piece, not its text)
    "The naïve café owners watched ﬁve boats sail slowly past",
    "Extraordinary bridges",
    "a",
    "Every morning people walk to the old stone bridge near the river bank",
]
TASKS = {
    "plain": MixSpec([0.3, 1.0, -0.5], gamma=1.7),
    "norm": MixSpec([0.3, 1.0, -0.5], gamma=1.7, layer_norm=True),
    "dirs": MixSpec([0.2, 0.5, -1.0, 1.5, 0.1], gamma=0.9, per_direction=True),
    "dirs_norm": MixSpec([0.2, 0.5, -1.0, 1.5, 0.1], 0.9, per_direction=True, layer_norm=True),
}
GRANULARITIES = ("token", "word")
POOLINGS = ("none", "mean", "max")
N_LAYERS = 3


# ----------------------------------------------------------------- the reference


def ref_mix(layers: np.ndarray, spec: MixSpec) -> np.ndarray:
    """``gamma * sum_j softmax(s)_j h_j`` over one sentence's token layers, in float64; the
    layer norm over each layer's positions and features; per direction: 2L+1 weights."""
    h = layers.astype(np.float64)
    if spec.layer_norm:
        h = np.stack([(x - x.mean()) / np.sqrt(x.var() + 1e-12) for x in h])
    s = np.asarray(spec.weights, dtype=np.float64)
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    if not spec.per_direction:
        out = np.einsum("l,ltd->td", w, h)
    else:
        p, nl = h.shape[-1] // 2, h.shape[0] - 1
        fwd = w[0] * h[0, :, :p] + np.einsum("l,ltd->td", w[1 : 1 + nl], h[1:, :, :p])
        bwd = w[0] * h[0, :, :p] + np.einsum("l,ltd->td", w[1 + nl :], h[1:, :, p:])
        out = np.concatenate([fwd, bwd], axis=-1)
    return spec.gamma * out


def ref_words(x: np.ndarray, tokens, axis: int) -> np.ndarray:
    """Each word's pieces averaged along the positions ``axis``, words in order."""
    ids = [t.word for t in tokens]
    words = sorted(set(ids))
    parts = [np.take(x, [i for i, w in enumerate(ids) if w == word], axis) for word in words]
    return np.concatenate([p.mean(axis=axis, keepdims=True) for p in parts], axis=axis)


def ref_answer(layers, tokens, *, idx, mix, granularity, pooling):
    """(layers output ``[K, P, D]`` or None, mix output ``[P, D]`` or None), pooled over P."""
    x = None if idx is None else layers[list(idx)].astype(np.float64)
    m = None if mix is None else ref_mix(layers, mix)
    if granularity == "word":
        x = None if x is None else ref_words(x, tokens, 1)
        m = None if m is None else ref_words(m, tokens, 0)
    pool = {"mean": np.mean, "max": np.max}.get(pooling)
    if pool is not None:
        x = None if x is None else pool(x, axis=1)
        m = None if m is None else pool(m, axis=0)
    return x, m


def close(got, want, what: str) -> None:
    assert (got is None) == (want is None), what
    if want is None:
        return
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = float(np.abs(got - want).max(initial=0.0))
    assert np.isfinite(got).all() and diff <= bound(want), f"{what}: differs by {diff:.3g}"


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny random model with a sentencepiece vocabulary of 80 (words split into pieces)
    and the four task mixes shipped with it."""
    d = tmp_path_factory.mktemp("agree")
    path = d / "model"
    save_artifact(tiny_model(seed=3), train_sentencepiece(d), path, tasks=TASKS)
    return path


@pytest.fixture(scope="module")
def emb(model) -> Embedder:
    return Embedder.load(model, threads=1)


@pytest.fixture(scope="module")
def raw(emb):
    """Per input (raw text, and the same words pre-tokenized): its tokens and its token
    layers, each sentence embedded alone."""
    out = {}
    for kind, inputs in (("text", SENTENCES), ("words", [s.split() for s in SENTENCES])):
        toks = emb.tokenize(inputs)
        out[kind] = [(t, emb.embed_tokens([[p.piece for p in t]])[0]) for t in toks]
    assert sum(len(t) for t, _ in out["text"]) >= 2 * sum(len(s.split()) for s in SENTENCES), (
        "the sweep needs a sub-word-heavy model"
    )
    return out


def mixes():
    """(name, what the library takes, the spec it means): tasks by name, the same inline,
    and the model's default (no task named 'default' here: the average of all layers)."""
    for name, spec in TASKS.items():
        yield f"task {name}", name, spec
        yield f"inline {name}", MixSpec(**{**spec.to_dict(), "meta": {}}), spec
    yield "default", "default", MixSpec.average(N_LAYERS)


# ----------------------------------------------------------------- the library


def test_library_sweep(emb, raw):
    for (label, mix, spec), gran, kind in itertools.product(
        [("layers only", None, None), *mixes()], GRANULARITIES, ("text", "words")
    ):
        inputs = SENTENCES if kind == "text" else [s.split() for s in SENTENCES]
        got = emb.embed(inputs, granularity=gran, mix=mix)
        for i, (res, (toks, layers)) in enumerate(zip(got, raw[kind], strict=True)):
            x, m = ref_answer(
                layers, toks, idx=range(N_LAYERS), mix=spec, granularity=gran, pooling="none"
            )
            what = f"library {label} {gran} {kind} sentence {i}"
            close(res.layers, x, what)
            close(res.mix, m, what)
            assert len(res.tokens) == res.layers.shape[1], what


# ----------------------------------------------------------------- the HTTP API


@pytest.fixture(scope="module")
def client(model, tmp_path_factory):
    settings = load_settings(
        model_path=model,
        threads=1,
        data_dir=tmp_path_factory.mktemp("api"),
        admin_keys="admin",
        cache=False,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def _post(client, body):
    r = client.post("/v1/embed", json={**body, "encoding": "base64"})
    assert r.status_code == 200, (body, r.text)
    return r.json()["data"]


def test_api_embed_sweep(client, raw):
    mix_bodies = [("layers only", {}, None)]
    for name, spec in TASKS.items():
        mix_bodies.append((f"task {name}", {"task": name}, spec))
        inline = {"mix": spec.weights, "gamma": spec.gamma}
        inline |= {"per_direction": spec.per_direction, "layer_norm": spec.layer_norm}
        mix_bodies.append((f"inline {name}", inline, spec))
    mix_bodies.append(("default", {"output": "mix"}, MixSpec.average(N_LAYERS)))
    for (label, body, spec), gran, pooling, kind in itertools.product(
        mix_bodies, GRANULARITIES, POOLINGS, ("text", "words")
    ):
        sentences = SENTENCES if kind == "text" else [s.split() for s in SENTENCES]
        outputs = [("mix", None)] if spec is not None else []
        if spec is not None and "output" not in body:
            outputs.append(("both", [0, 2]))
        if spec is None:
            outputs = [("layers", None), ("layers", [2]), ("layers", [0, 2])]
        for output, idx in outputs:
            req = {**body, "sentences": sentences, "granularity": gran, "pooling": pooling}
            req["output"] = output
            if idx is not None:
                req["layers"] = idx
            data = _post(client, req)
            want_idx = None if output == "mix" else (idx or list(range(N_LAYERS)))
            for i, (d, (toks, layers)) in enumerate(zip(data, raw[kind], strict=True)):
                x, m = ref_answer(
                    layers,
                    toks,
                    idx=want_idx,
                    mix=None if output == "layers" else spec,
                    granularity=gran,
                    pooling=pooling,
                )
                what = f"api {label} {output} {idx} {gran} {pooling} {kind} sentence {i}"
                close(None if "layers" not in d else decode_array(d["layers"]), x, what)
                close(None if "mix" not in d else decode_array(d["mix"]), m, what)


def test_api_embeddings_is_the_default_mix_mean_pooled(client, raw, emb):
    """``/v1/embeddings`` pools the default mix (the average, then the stored 'default'),
    unit length."""
    for default in (None, TASKS["dirs_norm"]):
        if default is not None:
            r = client.put("/v1/tasks/default", json=default.to_dict(), headers=ADMIN)
            assert r.status_code in (200, 201), r.text
        spec = default or MixSpec.average(N_LAYERS)
        r = client.post("/v1/embeddings", json={"model": "model", "input": SENTENCES})
        assert r.status_code == 200, r.text
        lib = emb.embed(SENTENCES, mix=default or "default")
        for i, (d, (toks, layers)) in enumerate(zip(r.json()["data"], raw["text"], strict=True)):
            _, want = ref_answer(
                layers, toks, idx=None, mix=spec, granularity="token", pooling="mean"
            )
            # unit length, as OpenAI's are (ELMO_OPENAI_NORMALIZE)
            unit = want / np.float32(np.linalg.norm(want.astype(np.float64)))
            close(np.array(d["embedding"], dtype=np.float32), unit, f"embeddings {i}")
            close(lib[i].mix.mean(axis=0), want, f"library default {i}")
    assert client.delete("/v1/tasks/default", headers=ADMIN).status_code == 200


# ----------------------------------------------------------------- embed-file


def _embed_file(tmp_path: Path, model: Path, lines: list[str], *flags: str) -> list[np.ndarray]:
    inp, out = tmp_path / "in.txt", tmp_path / "out.hdf5"
    inp.write_text("\n".join(lines) + "\n")
    argv = ["embed-file", str(inp), str(out), "--model", str(model), "--quiet", "--threads", "1"]
    assert main([*argv, *flags]) == 0
    with h5py.File(out, "r") as f:
        return [f[str(i)][()] for i in range(len(lines))]


def test_embed_file_sweep(tmp_path, model, raw):
    kinds = [("--all", None, None), ("--top", [N_LAYERS - 1], None)]
    kinds.append(("--average", None, MixSpec.average(N_LAYERS)))
    kinds += [(f"--task={name}", None, spec) for name, spec in TASKS.items()]
    for (flag, idx, spec), gran, kind in itertools.product(kinds, GRANULARITIES, ("text", "words")):
        flags = [flag, "--granularity", gran] + (["--whitespace"] if kind == "words" else [])
        got = _embed_file(tmp_path, model, SENTENCES, *flags)
        for i, (g, (toks, layers)) in enumerate(zip(got, raw[kind], strict=True)):
            want_idx = None if spec is not None else (idx or range(N_LAYERS))
            x, m = ref_answer(
                layers, toks, idx=want_idx, mix=spec, granularity=gran, pooling="none"
            )
            want = m if spec is not None else (x[0] if idx else x)
            close(g, want, f"embed-file {flag} {gran} {kind} line {i}")


# ----------------------------------------------------------------- embed-bulk


def bulk_combinations(every: bool = True):
    """(label, BulkOptions keywords, the mix it means or None): the whole product, or
    (``every=False``) each (granularity, pooling, input) once, the mixes taken in turn,
    so every option value is met (each real Ray run takes seconds)."""
    mixes = [("layers", {"output": "layers"}, None)]
    mixes += [(name, {"output": "mix", "task": name}, spec) for name, spec in TASKS.items()]
    mixes.append(("default", {"output": "mix"}, MixSpec.average(N_LAYERS)))
    rest = list(itertools.product(GRANULARITIES, POOLINGS, ("text", "words")))
    combos = (
        itertools.product(mixes, rest)
        if every
        else ((mixes[k % len(mixes)], r) for k, r in enumerate(rest))
    )
    for (label, opts, spec), (gran, pooling, kind) in combos:
        opts = {**opts, "granularity": gran, "pooling": pooling, "whitespace": kind == "words"}
        yield f"bulk {label} {gran} {pooling} {kind}", opts, spec


def check_bulk_rows(rows: list[dict], opts: dict, spec, raw) -> None:
    kind = "words" if opts["whitespace"] else "text"
    assert [r["text"] for r in rows] == SENTENCES
    for i, (row, (toks, layers)) in enumerate(zip(rows, raw[kind], strict=True)):
        x, m = ref_answer(
            layers,
            toks,
            idx=None if spec is not None else range(N_LAYERS),
            mix=spec,
            granularity=opts["granularity"],
            pooling=opts["pooling"],
        )
        want = m if spec is not None else x  # [K, P, D] / [P, D], pooled [K, D] / [D]
        if spec is None:  # stored layer-major per position: [P, K*D] (pooled [K*D])
            want = want.reshape(-1) if opts["pooling"] != "none" else want.transpose(1, 0, 2)
        want = want.reshape(-1) if opts["pooling"] != "none" else want.reshape(len(want), -1)
        got = np.array(row["embedding"], dtype=np.float32)
        close(got, want, f"{opts} sentence {i}")


def test_bulk_shard_sweep(tmp_path, model, emb, raw):
    """The shard work ``embed-bulk``'s actors run (``embed_shard``), with the mix the
    driver resolves, over every combination, without starting Ray."""
    import pyarrow.parquet as pq

    from elmo_bulk import MANIFESTS, BulkOptions, embed_shard, resolve_mix, scan_inputs

    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(SENTENCES) + "\n")
    (shard,) = scan_inputs([inp], shard_rows=100).shards
    for n, (_, kw, spec) in enumerate(bulk_combinations()):
        out = tmp_path / f"out{n}"
        (out / MANIFESTS).mkdir(parents=True)
        opts = BulkOptions(**kw)
        mix = resolve_mix(model, opts)[3]
        assert embed_shard(emb, shard, opts, out, mix, skip_bad=False).rows == len(SENTENCES)
        check_bulk_rows(pq.read_table(out / "part-00000.parquet").to_pylist(), kw, spec, raw)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.heavy  # ~60 s: make test-all (docs/testing.md)
def test_embed_bulk_on_ray_sweep(tmp_path, model, raw):
    """Real ``embed-bulk`` runs (a local Ray cluster, one actor): every mix kind,
    granularity, pooling and input kind met (the whole product runs without Ray above)."""
    import pyarrow.parquet as pq
    import ray

    from elmo_bulk import BulkOptions, run_bulk

    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(SENTENCES) + "\n")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        for n, (label, kw, spec) in enumerate(bulk_combinations(every=False)):
            out = tmp_path / f"out{n}"
            summary = run_bulk([inp], out, model, BulkOptions(**kw), actors=1, progress=False)
            assert summary.rows == len(SENTENCES), label
            rows = pq.read_table(out / "part-00000.parquet").to_pylist()
            meta = json.loads(pq.read_schema(out / "part-00000.parquet").metadata[b"elmo_service"])
            assert (meta["mix"] or {}).get("weights") == (spec and spec.weights), label
            check_bulk_rows(rows, kw, spec, raw)
    finally:
        ray.shutdown()


# ------------------------------------------------ the layer-normed word-granularity reproducer


def test_issue_36_layer_normed_task_at_word_granularity_agrees(tmp_path):
    """PUT a layer-normalised task, then the same two sentences at word granularity through
    ``POST /v1/embed`` and ``Embedder.embed``: they differed by 1.99 (the library averaged
    pieces before mixing). Both now equal the mix over tokens averaged per word."""
    model = ROOT / "models" / "default"
    task = {"weights": [0.3, 1.0, -0.5], "gamma": 1.7, "layer_norm": True}
    sentences = ["Unbelievably, the photosynthesizing seaweed flourished.", "Ceci n'est pas."]
    settings = load_settings(
        model_path=model, threads=1, data_dir=tmp_path, admin_keys="admin", cache=False
    )
    with TestClient(create_app(settings)) as c:
        assert c.put("/v1/tasks/x", json=task, headers=ADMIN).status_code == 201
        body = {"sentences": sentences, "task": "x", "granularity": "word", "encoding": "base64"}
        r = c.post("/v1/embed", json=body)
        assert r.status_code == 200, r.text
        api = [decode_array(d["mix"]) for d in r.json()["data"]]
    emb = Embedder.load(model, threads=1)
    lib = emb.embed(sentences, mix=MixSpec(**task), granularity="word")
    for i, toks in enumerate(emb.tokenize(sentences)):
        assert len({t.word for t in toks}) < len(toks), "the reproducer needs split words"
        (layers,) = emb.embed_tokens([[t.piece for t in toks]])
        _, want = ref_answer(
            layers, toks, idx=None, mix=MixSpec(**task), granularity="word", pooling="none"
        )
        close(api[i], want, f"api sentence {i}")
        close(lib[i].mix, want, f"library sentence {i}")
        # the other order (pieces averaged, then mixed) is really another answer here
        other = ref_mix(ref_words(layers, toks, 1), MixSpec(**task))
        assert np.abs(other - want).max() > 0.1


# ----------------------------------------------------------------- documents

# the sentences as one document: one sequence, context across them (docs/documents.md)
DOCUMENT = " ".join(SENTENCES * 2)
DOC_CHUNKS = (1, 7, 64, 512)


@pytest.fixture(scope="module")
def doc_raw(emb):
    """The document's tokens and its layers by one unchunked pass over the whole text."""
    toks = emb.tokenizer(DOCUMENT)
    assert len(toks) > 64, "the sweep needs a document longer than the middle chunk size"
    return toks, emb.embed_tokens([[t.piece for t in toks]])[0]


def test_document_library_sweep(emb, doc_raw):
    toks, layers = doc_raw
    for (label, mix, spec), gran, chunk in itertools.product(
        [("layers only", None, None), *mixes()], GRANULARITIES, DOC_CHUNKS
    ):
        parts = list(emb.embed_document(DOCUMENT, chunk, granularity=gran, mix=mix))
        x, m = ref_answer(
            layers, toks, idx=range(N_LAYERS), mix=spec, granularity=gran, pooling="none"
        )
        what = f"library document {label} {gran} chunk {chunk}"
        close(np.concatenate([p.layers for p in parts], axis=1), x, what)
        close(None if mix is None else np.concatenate([p.mix for p in parts]), m, what)


def _post_document(client, body) -> list[dict]:
    r = client.post("/v1/embed/document", json={**body, "encoding": "base64"})
    assert r.status_code == 200, (body, r.text)
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[-1].get("done") is True, lines[-1]
    assert lines[-1]["chunks"] == len(lines) - 1
    assert [d["chunk"] for d in lines[:-1]] == list(range(len(lines) - 1))
    return lines


def what_listed(*args) -> str:
    return "done's tokens count the positions the lines listed " + " ".join(map(str, args))


def test_api_document_sweep(client, doc_raw):
    toks, layers = doc_raw
    bodies = [("layers", {"output": "layers"}, None)]
    bodies += [(f"task {n}", {"task": n}, s) for n, s in TASKS.items()]
    norm = TASKS["dirs_norm"]
    inline = {"mix": norm.weights, "gamma": norm.gamma, "per_direction": True, "layer_norm": True}
    bodies.append(("inline dirs_norm", inline, norm))
    # 512 is over this model's per-sentence limit (64), which holds each chunk of an answer
    combos = itertools.product(bodies, GRANULARITIES, POOLINGS, (1, 7, 64))
    for (label, body, spec), gran, pooling, chunk in combos:
        req = {**body, "document": DOCUMENT, "granularity": gran, "pooling": pooling}
        req["chunk_tokens"] = chunk
        lines = _post_document(client, req)
        data = lines[:-1]
        listed = sum(len(d["words" if gran == "word" else "tokens"]) for d in data)
        assert lines[-1]["tokens"] == listed, what_listed(label, gran, pooling)
        if pooling == "none":
            assert listed == (len(toks) if gran == "token" else len({t.word for t in toks}))
        x, m = ref_answer(
            layers,
            toks,
            idx=None if spec is not None else range(N_LAYERS),
            mix=spec,
            granularity=gran,
            pooling=pooling,
        )
        what = f"api document {label} {gran} {pooling} chunk {chunk}"
        axis = 1 if pooling == "none" else None
        got_x = [decode_array(d["layers"]) for d in data if "layers" in d]
        got_m = [decode_array(d["mix"]) for d in data if "mix" in d]
        if pooling != "none":
            assert len(data) == 1, what
            close(got_x[0] if got_x else None, x, what)
            close(got_m[0] if got_m else None, m, what)
            continue
        close(np.concatenate(got_x, axis=axis) if got_x else None, x, what)
        close(np.concatenate(got_m, axis=0) if got_m else None, m, what)
        key = "words" if gran == "word" else "tokens"
        spans = [(p["start"], p["end"]) for d in data for p in d[key]]
        if gran == "token":
            assert spans == [(t.start, t.end) for t in toks], what
        else:
            assert len(spans) == len({t.word for t in toks}), what


def test_api_document_errors(client):
    """Refused before the stream starts: ordinary 4xx JSON naming the field."""
    cases = [
        ({"document": ""}, 422, "document"),
        ({"document": "x" * (1 << 20)}, 422, "document"),
        ({"document": DOCUMENT, "chunk_tokens": 0}, 422, "chunk_tokens"),
        ({"document": DOCUMENT, "chunk_tokens": 10**6}, 413, "chunk_tokens"),
        ({"document": DOCUMENT, "task": "nope"}, 422, "task"),
        ({"document": ["a", " "]}, 422, "document[1]"),
        ({"sentences": ["a"]}, 422, "sentences"),
    ]
    for body, status, field in cases:
        r = client.post("/v1/embed/document", json=body)
        assert r.status_code == status, (body, r.status_code, r.text[:300])
        err = r.json()
        assert err["field"] == field, (body, err)
        assert "Traceback" not in r.text


def test_api_document_size_limits(model, tmp_path):
    """A document's own limits (ELMO_MAX_DOCUMENT_TOKENS, ELMO_MAX_DOCUMENT_CHARS): 413
    naming the field, before the stream starts."""
    settings = load_settings(
        model_path=model,
        threads=1,
        data_dir=tmp_path,
        cache=False,
        max_document_tokens=20,
        max_document_chars=200,
    )
    with TestClient(create_app(settings)) as c:
        for doc, what in ((DOCUMENT[:150], "tokens"), (DOCUMENT, "characters")):
            r = c.post("/v1/embed/document", json={"document": doc})
            assert r.status_code == 413, r.text
            assert r.json()["field"] == "document" and what in r.json()["message"], r.text
        r = c.post("/v1/embed/document", json={"document": SENTENCES[1]})
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["done"], r.text


def test_api_document_error_mid_stream(client, monkeypatch):
    """An error met once the stream has begun (here the encoding of chunk 2 refuses its
    values, as a float16 overflow does) is a last line naming the field, after the chunks
    already sent; no "done" line follows. Anything else is an "internal_error" line."""
    from elmo_api.routers import document as route
    from elmo_service.errors import InputError

    line = route._line

    def failing(chunk, *args):
        if chunk.index == 2:
            raise InputError("values beyond float16's range", field="dtype")
        return line(chunk, *args)

    monkeypatch.setattr(route, "_line", failing)
    body = {"document": DOCUMENT, "chunk_tokens": 7, "priority": "batch"}
    r = client.post("/v1/embed/document", json=body)
    assert r.status_code == 200, r.text
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert [d.get("chunk") for d in lines[:-1]] == [0, 1]
    assert lines[-1] == {
        "error": {
            "code": "invalid_input",
            "message": "values beyond float16's range",
            "field": "dtype",
            "status": 422,  # what the same error answers before the stream (api/errors.py)
        }
    }

    def broken(chunk, *args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(route, "_line", broken)
    r = client.post("/v1/embed/document", json={"document": DOCUMENT})
    (only,) = [json.loads(x) for x in r.text.splitlines()]
    assert only["error"]["code"] == "internal_error" and only["error"]["status"] == 500
    assert "a bug" not in r.text


def test_embed_file_documents(tmp_path, model, emb, doc_raw):
    """``embed-file --documents``: a line per document, one dataset each, chunk by chunk."""
    toks, layers = doc_raw
    other = SENTENCES[1]
    other_toks = emb.tokenizer(other)
    other_layers = emb.embed_tokens([[t.piece for t in other_toks]])[0]
    for (flag, idx, spec), gran, chunk in itertools.product(
        [("--all", range(N_LAYERS), None), ("--task=norm", None, TASKS["norm"])],
        GRANULARITIES,
        (1, 7, 64),
    ):
        flags = [flag, "--granularity", gran, "--documents", "--chunk-tokens", str(chunk)]
        got = _embed_file(tmp_path, model, [DOCUMENT, other], *flags)
        for g, (t, x) in zip(got, [(toks, layers), (other_toks, other_layers)], strict=True):
            want_x, want_m = ref_answer(x, t, idx=idx, mix=spec, granularity=gran, pooling="none")
            close(g, want_m if spec is not None else want_x, f"embed-file {flag} {gran} {chunk}")


def test_embed_file_documents_advanced_together_equal_each_alone(tmp_path, model, emb, doc_raw):
    """``--documents-at-once``: documents of different lengths advance together, a row each,
    a finished one replaced by the next line; every dataset and ``sentence_to_index`` (the
    last of two equal lines wins) are what one document at a time gives, and the library's."""
    toks, layers = doc_raw
    lines = [SENTENCES[1], DOCUMENT, SENTENCES[1], SENTENCES[2], SENTENCES[0]]
    got = {}
    for at_once in (1, 2, 64):
        flags = ["--all", "--documents", "--chunk-tokens", "16", "--documents-at-once"]
        got[at_once] = _embed_file(tmp_path, model, lines, *flags, str(at_once))
        with h5py.File(tmp_path / "out.hdf5", "r") as f:
            index = json.loads(f["sentence_to_index"][0])
        assert index == {SENTENCES[1]: "2", DOCUMENT: "1", SENTENCES[2]: "3", SENTENCES[0]: "4"}
        assert list(index) == [SENTENCES[1], DOCUMENT, SENTENCES[2], SENTENCES[0]]
    for i, line in enumerate(lines):
        for at_once in (2, 64):
            close(got[at_once][i], got[1][i], f"line {i}, {at_once} at once")
        if line == DOCUMENT:
            want, _ = ref_answer(
                layers, toks, idx=range(N_LAYERS), mix=None, granularity="token", pooling="none"
            )
            close(got[1][i], want, "the document")


def test_bulk_shard_documents(tmp_path, model, emb, doc_raw):
    """``embed-bulk --documents``: a row per document line, its vectors by document mode."""
    import pyarrow.parquet as pq

    from elmo_bulk import MANIFESTS, BulkOptions, embed_shard, resolve_mix, scan_inputs

    toks, layers = doc_raw
    inp = tmp_path / "in.txt"
    inp.write_text(DOCUMENT + "\n" + DOCUMENT + "\n")
    (shard,) = scan_inputs([inp], shard_rows=100).shards
    for n, (task, spec) in enumerate([(None, None), ("norm", TASKS["norm"])]):
        for gran, pooling in itertools.product(GRANULARITIES, POOLINGS):
            out = tmp_path / f"out{n}{gran}{pooling}"
            (out / MANIFESTS).mkdir(parents=True)
            kw = {"output": "mix" if task else "layers", "task": task, "granularity": gran}
            opts = BulkOptions(**kw, pooling=pooling, documents=True)
            mix = resolve_mix(model, opts)[3]
            assert embed_shard(emb, shard, opts, out, mix, skip_bad=False).rows == 2
            rows = pq.read_table(out / "part-00000.parquet").to_pylist()
            x, m = ref_answer(
                layers,
                toks,
                idx=None if spec else range(N_LAYERS),
                mix=spec,
                granularity=gran,
                pooling=pooling,
            )
            want = m if spec is not None else x
            if spec is None:
                want = want.reshape(-1) if pooling != "none" else want.transpose(1, 0, 2)
            want = want.reshape(-1) if pooling != "none" else want.reshape(len(want), -1)
            for row in rows:
                close(np.array(row["embedding"], np.float32), want, f"bulk {kw} {pooling}")
