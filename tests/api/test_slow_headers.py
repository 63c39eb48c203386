"""Dripped headers do not lock embeds out (#50 item 7), against a real ``elmo-service serve``.

Found: 1,100 sockets sent straight to a replica, each sending a header byte every 2 s,
made 16 of 19 embeds answer 503 while ``/readyz`` stayed 200: a socket that had sent one
byte counted as busy for the whole header timeout. Scaled down here: 300 such sockets
against a connection limit of 64. Embeds must answer 200 throughout (and ``/readyz``,
truthfully, 200); the sockets are still cut off at the header deadline with a 408.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.support.replicas import Replica

pytestmark = pytest.mark.slow  # a server process and 300 sockets for ~6 s

SOCKETS, LIMIT, HEADER_S, DRIPS = 300, 64, 6, 5
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64 + b"\r\n\r\n"


def test_sockets_dripping_headers_leave_embeds_answered(tiny_model_dir, tmp_path):
    env = {
        "ELMO_MODEL_PATH": str(tiny_model_dir),
        "ELMO_DATA_DIR": str(tmp_path),
        "ELMO_HTTP_MAX_CONNECTIONS": str(LIMIT),
        "ELMO_HTTP_HEADER_TIMEOUT": str(HEADER_S),
    }
    replica = Replica(env, tmp_path, "drip")
    replica.start()
    socks: list[socket.socket] = []
    try:
        replica.wait_ready()
        socks = [socket.create_connection(("127.0.0.1", replica.port)) for _ in range(SOCKETS)]
        answers: list[int] = []
        ready: list[int] = []
        with httpx.Client(base_url=replica.url, timeout=10) as c:
            # a count of rounds, not a time: on a slow machine the rounds only take longer
            # (a socket cut at its deadline meanwhile frees its slot: never a false failure)
            for sent in range(DRIPS):
                for s in socks:  # one more header byte each (never the whole headers)
                    s.sendall(REQUEST[sent : sent + 1])
                r = c.post("/v1/embed", json={"sentences": ["a b c"]})
                answers.append(r.status_code)
                ready.append(c.get("/readyz").status_code)
                time.sleep(0.3)
        assert answers == [200] * DRIPS, answers
        assert ready == [200] * len(ready), ready
        # the dripping sockets still meet the header deadline: a 408, then closed
        for s in socks[:20]:
            s.settimeout(HEADER_S + 5)
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
    finally:
        for s in socks:
            s.close()
        replica.stop()
