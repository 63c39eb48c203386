"""``elmo-service embed-bulk``: Parquet shards on a real local Ray cluster (one CPU, one
actor, the tiny model): the same vectors as ``embed-file`` and the API, resume that
redoes only what is missing or damaged, and bad input named by file and line."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa  # the bulk extra (in the test extra)
import pyarrow.parquet as pq
import pytest

from elmo_bulk import (
    MANIFESTS,
    SKIPPED_FILE,
    BulkOptions,
    run_bulk,
    scan_inputs,
    verify_shard,
)
from elmo_cli.main import main
from elmo_service.artifact import read_header
from elmo_service.errors import ConfigError, InputError
from tests.support.bulk_run import one_shard_of_six, start_bulk, wait_for_shards
from tests.support.core_fixtures import generated_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for the module: a run reuses it rather than starting its own."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _inputs(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(generated_text(7, seed=1))
    b.write_text(generated_text(5, seed=2))
    return [a, b]


def _rows(out: Path) -> dict[int, dict]:
    """Every row of every shard, by id."""
    rows = {}
    for p in sorted(out.glob("part-*.parquet")):
        for r in pq.read_table(p).to_pylist():
            rows[r["id"]] = r
    return rows


def _embed_file(tmp_path: Path, model: Path, lines: list[str], *flags: str) -> h5py.File:
    inp = tmp_path / "all.txt"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "all.hdf5"
    argv = ["embed-file", str(inp), str(out), "--model", str(model), "--quiet", "--threads", "1"]
    assert main([*argv, *flags]) == 0
    return h5py.File(out, "r")


def test_scan_numbers_lines_over_all_inputs_and_cuts_shards_across_files(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"one\ntwo\n\nthree\n")
    b.write_bytes(b"caf\xe9\r\nfive")  # latin-1, CRLF, no final newline
    scan = scan_inputs([a, b], shard_rows=4)
    assert [(s.first_id, s.n) for s in scan.shards] == [(0, 4), (4, 2)]
    assert [(g.file, g.first_line, g.n) for g in scan.shards[1].segments] == [(str(b), 1, 2)]
    # the blank line 3 of a is an empty sentence (#51), not a bad line
    assert [(x["id"], x["file"], x["line"]) for x in scan.bad] == [(4, str(b), 1)]
    assert "line 1 of" in scan.bad[0]["reason"] and "not UTF-8" in scan.bad[0]["reason"]
    assert [i["lines"] for i in scan.inputs] == [4, 2]


@pytest.mark.slow  # imports Ray, or loads a model
def test_bad_input_is_named_before_any_work_starts(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\nnot \xff utf-8\n")
    out = tmp_path / "out"
    argv = ["embed-bulk", str(bad), "--out", str(out), "--model", str(tiny_model_dir), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"line 2 of {bad}" in err and "not UTF-8" in err and "--skip-bad" in err
    assert not out.exists()  # refused before the folder was made, or Ray started
    assert main([*argv[:1], str(tmp_path / "missing.txt"), *argv[2:]]) == 2
    assert "missing.txt: not a file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--task gives a mix"):
        run_bulk([bad], out, tiny_model_dir, BulkOptions(output="layers", task="shipped"))


@pytest.mark.slow
@pytest.mark.ray
def test_vectors_equal_embed_file_and_the_api(ray_cluster, tmp_path, tiny_model_dir):
    from fastapi.testclient import TestClient

    from elmo_api.encoding import decode_array
    from elmo_api.main import create_app
    from elmo_api.settings import load_settings

    inputs = _inputs(tmp_path)
    lines = [x for p in inputs for x in p.read_text().splitlines()]
    tokens = run_bulk(
        inputs,
        tmp_path / "tok",
        tiny_model_dir,
        BulkOptions(shard_rows=5),
        actors=1,
        progress=False,
    )
    assert (tokens.shards, tokens.written, tokens.rows) == (3, 3, len(lines))
    pooled = run_bulk(
        inputs,
        tmp_path / "pool",
        tiny_model_dir,
        BulkOptions(output="mix", task="shipped", pooling="mean", shard_rows=5),
        actors=1,
        progress=False,
    )
    assert pooled.rows == len(lines)

    h5 = _embed_file(tmp_path, tiny_model_dir, lines, "--all")
    rows = _rows(tmp_path / "tok")
    assert sorted(rows) == list(range(len(lines)))
    for i, line in enumerate(lines):
        ref = h5[str(i)][()]  # [L+1, T, D]
        got = np.array(rows[i]["embedding"], dtype=np.float32)  # [T, (L+1)*D], layer-major
        got = got.reshape(ref.shape[1], ref.shape[0], ref.shape[2]).transpose(1, 0, 2)
        assert rows[i]["text"] == line and len(rows[i]["positions"]) == ref.shape[1]
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)

    table = pq.read_table(tmp_path / "pool" / "part-00000.parquet")
    assert pa.types.is_fixed_size_list(table.schema.field("embedding").type)
    assert table.schema.field("embedding").type.value_type == pa.float32()
    meta = json.loads(table.schema.metadata[b"elmo_service"])
    assert meta["task"] == "shipped" and meta["layout"]["row_shape"] == [16]
    settings = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path / "api")
    with TestClient(create_app(settings)) as client:
        r = client.post(
            "/v1/embed", json={"sentences": lines, "task": "shipped", "pooling": "mean"}
        )
        assert r.status_code == 200, r.text
        assert meta["model_version"] == r.json()["model"]["version"]
        api = [decode_array(d["mix"]) for d in r.json()["data"]]
    rows = _rows(tmp_path / "pool")
    for i in range(len(lines)):
        np.testing.assert_allclose(np.array(rows[i]["embedding"]), api[i], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.ray
def test_rerun_redoes_only_damaged_or_unfinished_shards(ray_cluster, tmp_path, tiny_model_dir):
    inputs, out = _inputs(tmp_path), tmp_path / "out"
    opts = BulkOptions(pooling="max", shard_rows=5)
    first = run_bulk(inputs, out, tiny_model_dir, opts, actors=1, progress=False)
    assert (first.shards, first.written) == (3, 3)
    before = _rows(out)
    kept = out / "part-00000.parquet"
    kept_stat = kept.stat().st_mtime_ns

    damaged = out / "part-00001.parquet"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the sha256 tells
    damaged.write_bytes(bytes(data))
    (out / MANIFESTS / "part-00002.json").unlink()  # killed after the Parquet, before its manifest
    (out / ".part-00002.parquet.dead.tmp").write_bytes(b"half")  # a killed writer's temporary

    again = run_bulk(inputs, out, tiny_model_dir, opts, actors=1, progress=False)
    assert (again.done_before, again.written, again.rows) == (1, 2, first.rows)
    assert kept.stat().st_mtime_ns == kept_stat  # the good shard was not rewritten
    assert not list(out.glob(".part-*.tmp"))
    after = _rows(out)
    assert after.keys() == before.keys()
    for i in before:
        np.testing.assert_array_equal(after[i]["embedding"], before[i]["embedding"])

    # the same folder with other options would mix two kinds of vectors: refused
    with pytest.raises(ConfigError, match="another run.*options"):
        run_bulk(inputs, out, tiny_model_dir, BulkOptions(pooling="mean", shard_rows=5))


@pytest.mark.slow
@pytest.mark.ray
def test_an_over_limit_sentence_is_refused_or_skipped_and_listed(
    ray_cluster, tmp_path, tiny_model_dir
):
    limit = read_header(tiny_model_dir).config.max_sentence_tokens
    inp = tmp_path / "in.txt"
    inp.write_text("a short one\n" + " ".join(["word"] * (limit + 1)) + "\nanother short one\n")
    with pytest.raises(InputError, match=rf"line 2 of {inp}.*limit is {limit}.*--skip-bad"):
        run_bulk([inp], tmp_path / "out", tiny_model_dir, BulkOptions(), actors=1, progress=False)
    assert not list((tmp_path / "out").glob("part-*.parquet"))

    done = run_bulk(
        [inp],
        tmp_path / "skip",
        tiny_model_dir,
        BulkOptions(),
        actors=1,
        skip_bad=True,
        progress=False,
    )
    assert done.rows == 2 and [s["line"] for s in done.skipped] == [2]
    assert sorted(_rows(tmp_path / "skip")) == [0, 2]  # ids keep the lines' positions
    listed = [json.loads(x) for x in (tmp_path / "skip" / SKIPPED_FILE).read_text().splitlines()]
    assert [(s["id"], s["line"]) for s in listed] == [(1, 2)]
    assert f"limit is {limit}" in listed[0]["reason"]


@pytest.mark.slow
@pytest.mark.ray
def test_a_killed_run_loses_only_the_shards_in_flight(ray_cluster, tmp_path, tiny_model_dir):
    """SIGKILL to the whole command (driver, its local Ray cluster, the actors) mid-run;
    the re-run keeps every shard that was whole and redoes the rest."""
    inp, out = tmp_path / "in.txt", tmp_path / "out"
    # 50 shards: the kill comes 3 shards in, with ample left that it must cut (the re-run
    # writes each of them, so more lines only cost time)
    inp.write_text(generated_text(100, seed=3))
    proc = start_bulk(inp, out, tiny_model_dir, "--actors", "1", "--shard-rows", "2")
    try:
        wait_for_shards(proc, out, 3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the command and its Ray
        proc.wait()
        proc.stderr.close()
    scan = scan_inputs([inp], shard_rows=2)
    whole = sum(
        verify_shard(out, s, read_header(tiny_model_dir).version) is not None for s in scan.shards
    )
    assert 3 <= whole < len(scan.shards), "the run must be killed mid-way"

    again = run_bulk(
        [inp], out, tiny_model_dir, BulkOptions(shard_rows=2), actors=1, progress=False
    )
    # every shard whole at the kill is kept, the rest written once. Under load a shard can
    # still turn whole after the count (seen once: 4 kept against 3 counted; a process of
    # the killed run finishing its atomic rename): it is kept too, never redone
    assert again.done_before >= whole
    assert again.done_before + again.written == len(scan.shards)
    assert sorted(_rows(out)) == list(range(100))
    assert not list(out.glob(".part-*.tmp"))


@pytest.mark.slow  # imports Ray, or loads a model
def test_full_verification_catches_a_flipped_byte_and_quick_a_truncation(tmp_path, tiny_model_dir):
    out, shard, emb = one_shard_of_six(tmp_path, tiny_model_dir)
    parquet = out / "part-00000.parquet"
    good = parquet.read_bytes()
    assert verify_shard(out, shard, emb.version, full=True)["rows"] == 6
    assert verify_shard(out, shard, "another-version", full=False) is None

    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    parquet.write_bytes(bytes(flipped))
    assert verify_shard(out, shard, emb.version, full=True) is None
    assert verify_shard(out, shard, emb.version, full=False) is not None  # quick: by design

    parquet.write_bytes(good[:-100] + bytes(100))  # same size, footer destroyed
    assert verify_shard(out, shard, emb.version, full=False) is None
    parquet.write_bytes(good[:-10])
    assert verify_shard(out, shard, emb.version, full=False) is None


def test_without_the_extra_the_command_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: import fails
    inp = tmp_path / "in.txt"
    inp.write_text("a sentence\n")
    argv = ["embed-bulk", str(inp), "--out", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ray is missing" in err and "pip install 'elmo-service[bulk]'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # loads a model
def test_a_broken_model_writes_nothing(tmp_path):
    import torch

    from elmo_bulk import embed_shard
    from elmo_service.artifact import save_artifact
    from elmo_service.embedder import Embedder
    from elmo_service.tokenizers import WordTokenizer
    from tests.support.core_fixtures import tiny_model

    model = tiny_model()
    with torch.no_grad():
        # finite weights (the loader refuses NaN) whose products overflow float32
        model.get_parameter("forward_layers.1.w_proj.weight").fill_(3e38)
    save_artifact(model, WordTokenizer(), tmp_path / "broken")
    inp, out = tmp_path / "in.txt", tmp_path / "out"
    inp.write_text("the river bank\n")
    (out / MANIFESTS).mkdir(parents=True)
    (shard,) = scan_inputs([inp], shard_rows=10).shards
    emb = Embedder.load(tmp_path / "broken", threads=1)
    r = embed_shard(emb, shard, BulkOptions(pooling="mean"), out, None, skip_bad=True)
    assert r.model_fault and f"line 1 of {inp}" in r.error and "non-finite" in r.error
    assert not list(out.rglob("*part-*"))


def test_embed_bulk_arguments_all_have_help():
    import argparse

    from elmo_cli.core import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["embed-bulk"]
    missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.ray
def test_an_actor_that_cannot_start_is_one_error_naming_why(ray_cluster, tmp_path, tiny_model_dir):
    """An actor's constructor fails on a node that sees other model files: the driver's
    error is that one line, not Ray's remote traceback, and nothing is written."""
    from elmo_bulk.cluster import run_on_ray

    inp = tmp_path / "in.txt"
    inp.write_text("a short one\nanother short one\n")
    shards = scan_inputs([inp], 1).shards
    with pytest.raises(ConfigError, match="every node must see the same model files") as e:
        run_on_ray(
            shards,
            tmp_path,
            tiny_model_dir,
            "another",
            BulkOptions(),
            None,
            1,
            1,
            None,
            False,
            False,
        )
    assert len(e.value.message.splitlines()) == 1 and "Traceback" not in e.value.message
    assert not list(tmp_path.glob("part-*.parquet"))
