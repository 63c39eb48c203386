"""``embed-bulk`` under attack: a local Ray
cluster that listens on loopback only and dies with its driver, a full disk named in one
line, a manifest that cannot lie about its rows, a BOM that stays out of the text, and
shards cut so that every actor works."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from elmo_bulk import MANIFESTS, BulkOptions, embed_shard, scan_inputs, verify_shard
from elmo_bulk.plan import shard_size
from tests.support.bulk_run import bulk_cmd, one_shard_of_six, start_bulk, wait_for_shards
from tests.support.core_fixtures import generated_text

ROOT = Path(__file__).resolve().parents[2]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22), None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _address(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = bytes.fromhex(hexaddr.split(":")[0])
    # /proc/net/tcp{,6}: each 32-bit word in host (little-endian) order
    raw = b"".join(ip[i : i + 4][::-1] for i in range(0, len(ip), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return ipaddress.ip_address(socket.inet_ntop(family, raw))


def _listening(pids: list[int]) -> dict[int, list[ipaddress._BaseAddress]]:
    """pid -> the local addresses of its listening TCP sockets."""
    by_inode = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                by_inode[f[9]] = _address(f[1])
    found: dict[int, list] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in by_inode:
                found.setdefault(pid, []).append(by_inode[target[8:-1]])
    return found


def _loopback(ip) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def test_the_address_reader_reads_proc_net():
    assert str(_address("0100007F:1F90")) == "127.0.0.1"
    assert str(_address("00000000:0050")) == "0.0.0.0"
    v6 = _address("0000000000000000FFFF00000100007F:A1B2")
    assert _loopback(v6) and not _loopback(_address("00000000000000000000000000000000:0050"))


@pytest.mark.slow
@pytest.mark.ray
def test_the_local_cluster_listens_on_loopback_only_and_dies_with_its_driver(
    tmp_path, tiny_model_dir
):
    """Every process of the run's local cluster listens on 127.0.0.1 only; after a SIGKILL
    of the driver alone, none of them is alive 10 s later; Ray's known-harmless
    ``core_worker.cc`` line is not on the user's screen."""
    inp, out = tmp_path / "in.txt", tmp_path / "out"
    inp.write_text(generated_text(400, seed=3))
    proc = start_bulk(inp, out, tiny_model_dir, "--actors", "1", "--shard-rows", "2")
    family: dict[int, str] = {}
    try:
        wait_for_shards(proc, out, 2)
        pids = _descendants(proc.pid)
        family = {p: s for p in pids if (s := _start_time(p)) is not None}
        names = {_comm(p) for p in family}
        assert {"gcs_server", "raylet"} <= names, names
        sockets = _listening([proc.pid, *family])
        assert len(sockets) >= 3, sockets  # GCS, raylet, the workers: seen, or the test is void
        wide = {
            f"{_comm(p)}[{p}]": [str(a) for a in addrs if not _loopback(a)]
            for p, addrs in sockets.items()
        }
        assert not {k: v for k, v in wide.items() if v}, f"listening beyond loopback: {wide}"

        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, not its group
        proc.wait()
        err = proc.stderr.read().decode()
        assert "core_worker.cc" not in err, err
        bound = time.monotonic() + 10
        alive = family
        while alive and time.monotonic() < bound:
            time.sleep(0.2)
            alive = {p: s for p, s in family.items() if _start_time(p) == s}
        assert not alive, f"outlived the driver: {[f'{_comm(p)}[{p}]' for p in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p, s in family.items():  # never leave a stray cluster behind a failed test
            if _start_time(p) == s:
                os.kill(p, signal.SIGKILL)
        proc.stderr.close()


def _unshare() -> list[str]:
    """A private mount namespace (root), or a user namespace that maps us to root."""
    base = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-r", "--mount"]
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1) (util-linux) to mount a small tmpfs")
    probe = subprocess.run([*base, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")
    return base


@pytest.mark.slow
@pytest.mark.ray
def test_a_full_disk_ends_in_one_line_naming_the_folder(tmp_path, tiny_model_dir):
    """--out on a 96 KiB tmpfs: shards fill it; the command stops with one line that
    names the folder and the cause, and the shards written before it are whole."""
    inp, disk = tmp_path / "in.txt", tmp_path / "disk"
    inp.write_text(generated_text(400, seed=5))
    disk.mkdir()
    out = disk / "out"
    cmd = bulk_cmd(inp, out, tiny_model_dir, "--actors", "1", "--shard-rows", "40")
    script = (
        f"mount -t tmpfs -o size=96k tmpfs {disk} && {{ {' '.join(cmd)}; rc=$?; "
        f"ls {out}/{MANIFESTS} | grep -c json; exit $rc; }}"
    )
    r = subprocess.run(
        [*_unshare(), "sh", "-c", script],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    # the plan's line, printed before work starts, then the error in one line
    lines = [x for x in r.stderr.strip().splitlines() if " shards of up to " not in x]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {out}: cannot write"), lines[0]
    assert "No space left on device" in lines[0], lines[0]
    assert int(r.stdout.split()[-1]) < 10  # it did run out of space mid-way


@pytest.mark.slow  # loads a model
def test_full_verification_checks_the_footer_row_count_against_the_manifest(
    tmp_path, tiny_model_dir
):
    out, shard, emb = one_shard_of_six(tmp_path, tiny_model_dir)
    path = out / MANIFESTS / "part-00000.json"
    m = json.loads(path.read_text())
    assert verify_shard(out, shard, emb.version, full=True)["rows"] == 6
    path.write_text(json.dumps({**m, "rows": 5}))  # size and sha256 still right
    assert verify_shard(out, shard, emb.version, full=True) is None
    assert verify_shard(out, shard, emb.version, full=False) is None


@pytest.mark.slow  # loads a model
def test_a_byte_order_mark_stays_out_of_the_first_rows_text(tmp_path, tiny_model_dir):
    from elmo_service.embedder import Embedder

    inp, out = tmp_path / "in.txt", tmp_path / "out"
    inp.write_bytes(b"\xef\xbb\xbfthe river bank\nthe second line\n")
    (out / MANIFESTS).mkdir(parents=True)
    scan = scan_inputs([inp], shard_rows=10)
    assert not scan.bad
    emb = Embedder.load(tiny_model_dir, threads=1)
    embed_shard(emb, scan.shards[0], BulkOptions(), out, None, skip_bad=False)
    rows = pq.read_table(out / "part-00000.parquet").to_pylist()
    assert [r["text"] for r in rows] == ["the river bank", "the second line"]
    assert rows[0]["positions"] == ["the", "river", "bank"]
    bom_only = tmp_path / "bom.txt"
    bom_only.write_bytes(b"\xef\xbb\xbf\nnext\n")  # a BOM alone is a blank line: an empty row
    scan = scan_inputs([bom_only], shard_rows=10)
    assert not scan.bad
    embed_shard(emb, scan.shards[0], BulkOptions(), out, None, skip_bad=False)
    rows = pq.read_table(out / "part-00000.parquet").to_pylist()
    assert [r["text"] for r in rows] == ["", "next"]
    assert rows[0]["positions"] == [] and rows[0]["embedding"] == []
    pooled, out2 = BulkOptions(pooling="mean"), tmp_path / "pooled"
    (out2 / MANIFESTS).mkdir(parents=True)
    embed_shard(emb, scan.shards[0], pooled, out2, None, skip_bad=False)
    rows = pq.read_table(out2 / "part-00000.parquet").to_pylist()
    assert rows[0]["embedding"] == [0.0] * len(rows[1]["embedding"])  # the zero vector


def test_actors_and_threads_fill_the_cluster_without_sharing_a_core():
    from elmo_bulk.cluster import pool_shape

    assert pool_shape(2, None, None) == (2, 1)  # the default: an actor per CPU
    assert pool_shape(2, 1, None) == (1, 2)  # --actors 1: its threads take the CPUs left
    assert pool_shape(8, None, 2) == (4, 2) and pool_shape(2, 3, None) == (3, 1)


def test_the_stderr_filter_drops_only_rays_harmless_line(capfd):
    from elmo_bulk.cluster import harmless_lines_hidden

    line = (
        b"[2026-11-26 23:23:11,851 E 6849 6849] core_worker.cc:2465: Actor with class name: "
        b"'MapWorker' and ID: '12' has constructor arguments in the object store and "
        b"max_restarts > 0. See https://github.com/ray-project/ray/issues/53727\n"
    )
    with harmless_lines_hidden():
        os.write(2, b"kept before\n" + line + b"[2026-11-26 E 1 1] raylet.cc:9: a real one\n")
        os.write(2, b"\rembed:  50%|#####     | 2/4")  # a bar: no newline
        time.sleep(0.3)
        first = capfd.readouterr().err
        assert "embed:  50%" in first  # passed on before the run ends
        assert "kept before" in first and "raylet.cc:9: a real one" in first
        os.write(2, line[:40])  # a log line written in two parts
        os.write(2, line[40:])
    err = first + capfd.readouterr().err
    assert "core_worker.cc" not in err and "constructor arguments" not in err, err


def test_a_small_corpus_is_cut_so_that_every_actor_works(tmp_path):
    assert shard_size(3363, 2) == 1682 and shard_size(1, 8) == 1 and shard_size(10, 3) == 4
    inp = tmp_path / "in.txt"
    inp.write_text("a line\n" * 3363)
    scan = scan_inputs([inp], shard_size(3363, 2))
    assert [s.n for s in scan.shards] == [1682, 1681]


@pytest.mark.slow
@pytest.mark.ray
def test_the_default_shard_size_gives_every_actor_a_shard(tmp_path, tiny_model_dir):
    """3 actors, 30 lines, the default --shard-rows (10,000): three shards, each done by
    its own actor; a re-run with other --actors keeps the first plan."""
    from elmo_bulk.cluster import ray_deps, ray_session

    inp = tmp_path / "in.txt"
    inp.write_text(generated_text(30, seed=6))
    # one local cluster (the one a run starts: loopback, reaper; 3 CPUs) that the runs reuse as
    # they reuse a caller's, instead of each run that embeds starting and ending its own
    with ray_session(ray_deps(local=True), None, 3):
        _default_shards_and_resumes(inp, tmp_path, tiny_model_dir)


def _default_shards_and_resumes(inp: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    from elmo_bulk import run_bulk

    s = run_bulk([inp], tmp_path / "out", tiny_model_dir, BulkOptions(), actors=3, progress=False)
    assert s.shards == 3 and len({r.worker for r in s.results}) == 3
    again = run_bulk(
        [inp], tmp_path / "out", tiny_model_dir, BulkOptions(), actors=1, progress=False
    )
    assert (again.shards, again.done_before, again.written) == (3, 3, 0)

    # a folder of the previous version (no "shard_rows" in _bulk.json) still resumes
    out = tmp_path / "old"
    # one actor (one model load): --shard-rows 10 alone cuts the 30 lines into 3 shards
    run_bulk([inp], out, tiny_model_dir, BulkOptions(shard_rows=10), actors=1, progress=False)
    run = json.loads((out / "_bulk.json").read_text())
    del run["shard_rows"]
    (out / "_bulk.json").write_text(json.dumps(run))
    resumed = run_bulk(
        [inp], out, tiny_model_dir, BulkOptions(shard_rows=10), actors=1, progress=False
    )
    assert (resumed.shards, resumed.done_before) == (3, 3)
