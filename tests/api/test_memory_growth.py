"""Memory must flatten (#50): the RSS of a real ``elmo-service serve`` process over
segments of 10,000 requests each (embeds of many shapes, both embedding routes, the
refusals, tasks, models, probes), and over a loop of jobs (submitted, read, listed,
cancelled, refused: queued only, no worker trains on a shared 2-core machine). The first segment
fills what is meant to fill (the sentence cache, allocator pools, imports); the last
segment's growth must be small against it, and small in bytes.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import pytest

from tests.jobs.test_jobs import job_body, write_corpus
from tests.support.replicas import Replica

# a server process and ~30,000 requests (~90 s): make test-all (docs/testing.md)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SEGMENTS, PER_SEGMENT = 3, 10_000
JOBS, JOB_SEGMENTS = 100, 4
ADMIN = {"authorization": "Bearer admin"}
WORDS = [
    "the",
    "bank",
    "river",
    "boat",
    "rates",
    "raised",
    "we",
    "sat",
    "on",
    "watched",
    "a",
    "quiet",
    "town",
    "old",
    "dog",
]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


_POOL_RNG = random.Random(0)
# 300 distinct sentences (empty ones included): the cache holds them all after segment one
POOL = [
    " ".join(_POOL_RNG.choice(WORDS) for _ in range(_POOL_RNG.randint(0, 9))) for _ in range(300)
]


def _requests(rng: random.Random) -> list[tuple[str, str, dict | None]]:
    """One round of the mix."""
    sents = [rng.choice(POOL) for _ in range(rng.randint(1, 4))]
    return [
        ("POST", "/v1/embed", {"sentences": sents}),
        ("POST", "/v1/embed", {"sentences": sents, "output": "both", "granularity": "word"}),
        ("POST", "/v1/embed", {"sentences": sents, "pooling": "mean", "encoding": "base64"}),
        ("POST", "/v1/embeddings", {"input": sents, "model": "tiny"}),
        ("POST", "/v1/embed", {"sentences": []}),  # 422
        ("POST", "/v1/embed", {"sentences": ["a"], "task": "nope"}),  # 422 unknown task
        ("GET", "/v1/tasks", None),
        ("GET", "/v1/models", None),
        ("GET", "/readyz", None),
        ("GET", "/v1/nothing", None),  # 404
    ]


def _segment(url: str, n: int, seed: int) -> None:
    """``n`` requests from 2 threads with kept-alive connections; every answer < 500."""
    errors: list[str] = []

    def worker(k: int) -> None:
        rng = random.Random(seed * 10 + k)
        with httpx.Client(base_url=url, timeout=30) as c:
            done = 0
            while done < n // 2:
                for method, path, body in _requests(rng):
                    r = c.request(method, path, json=body)
                    if r.status_code >= 500:
                        errors.append(f"{method} {path}: {r.status_code} {r.text[:200]}")
                    done += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


def _growth(samples: list[int]) -> list[int]:
    return [b - a for a, b in zip(samples, samples[1:], strict=False)]


def test_rss_flattens_over_requests_and_jobs(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    write_corpus(data / "corpora" / "book.txt")
    env = {
        "ELMO_MODEL_PATH": str(tiny_model_dir),
        "ELMO_DATA_DIR": str(data),
        "ELMO_RUNS_DIR": str(tmp_path / "runs"),
        "ELMO_MODELS_DIR": str(tmp_path / "models"),
        "ELMO_ADMIN_KEYS": "admin",
        "ELMO_JOBS_EMBEDDED_WORKER": "false",
    }
    (tmp_path / "models").mkdir()
    server = Replica(env, tmp_path, "memory")
    server.start()
    try:
        server.wait_ready()
        pid = server.proc.pid
        rss = [_rss(pid)]
        for i in range(SEGMENTS):
            _segment(server.url, PER_SEGMENT, seed=i)
            rss.append(_rss(pid))
        grew = _growth(rss)
        print("RSS over requests (MB):", [round(x / 2**20, 1) for x in rss])
        # the last 10,000 requests grew it by little against the first, and by < 8 MB
        assert grew[-1] <= max(0.25 * grew[0], 2 * 2**20), [x / 2**20 for x in grew]
        assert grew[-1] < 8 * 2**20, [x / 2**20 for x in grew]

        # jobs: a fixed population (memory grows with the records stored, as every list
        # reads them all: measured apart, see docs/reliability.md), worked over and over
        with httpx.Client(base_url=server.url, timeout=30, headers=ADMIN) as c:
            ids = []
            for _ in range(JOBS):
                r = c.post("/v1/jobs", json=job_body(steps=5))
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            jobs = [_rss(pid)]
            for _ in range(JOB_SEGMENTS):
                for jid in ids:
                    assert c.get(f"/v1/jobs/{jid}").status_code == 200
                    assert c.get("/v1/jobs", params={"limit": 10}).status_code == 200
                    cancel = c.post(f"/v1/jobs/{jid}/cancel")  # idempotent once cancelled
                    assert cancel.status_code == 200 and cancel.json()["state"] == "cancelled"
                    bad = c.post("/v1/jobs", json=job_body(steps=5, corpus="/etc/passwd"))
                    assert bad.status_code == 422, bad.text
                jobs.append(_rss(pid))
        grew = _growth(jobs)
        print("RSS over jobs (MB):", [round(x / 2**20, 1) for x in jobs])
        assert grew[-1] <= max(0.25 * grew[0], 2 * 2**20), [x / 2**20 for x in grew]
        assert grew[-1] < 8 * 2**20, [x / 2**20 for x in grew]
    finally:
        server.stop()
