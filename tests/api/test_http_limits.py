"""Connection-level limits: header and body read deadlines (slowloris), keep-alive, concurrency.

A live uvicorn server with the options ``elmo-service serve`` uses
(:func:`elmo_api.http_protocol.uvicorn_options`), short deadlines so each case takes
about a second.
"""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from elmo_api.http_protocol import uvicorn_options
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow  # a live uvicorn server and socket read deadlines

HEADER_S, BODY_S = 0.5, 0.8


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path_factory.mktemp("d"),
        http_header_timeout=HEADER_S, http_body_timeout=BODY_S, http_keepalive_timeout=1,
        http_max_connections=64,
    )  # fmt: skip
    with LiveServer(create_app(s), **uvicorn_options(s)) as srv:
        yield srv


def _connect(live) -> socket.socket:
    # a deadline against a hang, not a timing: without the server's deadlines nothing would
    # ever close these sockets, and recv would fail here; with them, the 408 says which fired
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    sock.settimeout(30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_settings_reach_uvicorn(tiny_model_dir, tmp_path):
    s = load_settings(model_path=tiny_model_dir, data_dir=tmp_path)
    opts = uvicorn_options(s)
    # the connection limit is the protocol's (health routes exempt), not uvicorn's
    assert opts["timeout_keep_alive"] == 5 and opts["limit_concurrency"] is None
    assert opts["http"].header_timeout == 10.0 and opts["http"].body_timeout == 30.0
    assert opts["http"].send_timeout == 30.0 and opts["http"].max_connections == 1024
    assert opts["http"].first_byte_timeout == 2.0


def test_a_socket_that_never_sends_is_closed(live):
    socks = [_connect(live) for _ in range(20)]
    for sock in socks:
        reply = _read_all(sock)  # returns once the server closed it
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
        sock.close()
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["code"] == "request_timeout" and "headers" in body["message"]


def test_headers_sent_a_byte_at_a_time_are_cut_off(live):
    sock = _connect(live)
    t0 = time.monotonic()
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    for i in range(len(request)):  # slowloris: a byte every 50 ms would take 5 s
        try:
            sock.sendall(request[i : i + 1])
        except OSError:
            break
        time.sleep(0.05)
        if time.monotonic() - t0 > HEADER_S + 2:
            break
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408 ")  # the header deadline: ~100 bytes never complete


def test_a_body_that_never_finishes_is_cut_off(live):
    sock = _connect(live)
    head = b"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"sentences": [')
    t0 = time.monotonic()
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408 ") and b"body" in reply
    assert time.monotonic() - t0 > BODY_S - 0.1  # not before the deadline (load only adds)


def test_normal_and_kept_alive_requests_are_unaffected(live):
    with httpx.Client(base_url=live.url) as client:
        for _ in range(3):  # one connection, kept alive between quick requests
            assert client.get("/healthz").status_code == 200
        time.sleep(HEADER_S + 0.2)  # idle for longer than the header deadline: keep-alive rules
        r = client.post("/v1/embed", json={"sentences": ["still served"]})
        assert r.status_code == 200


def test_an_idle_kept_alive_connection_is_closed(live):
    sock = _connect(live)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = _read_all(sock)  # the response, then the close after the 1 s keep-alive
    sock.close()
    assert reply.startswith(b"HTTP/1.1 200 ")


def test_unparsable_http_gets_the_json_error_shape(live):
    sock = _connect(live)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 400 ") and b"application/json" in reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["code"] == "invalid_http"


def _overloaded(r: httpx.Response) -> None:
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["code"] == "overloaded" and "ELMO_HTTP_MAX_CONNECTIONS" in body["message"]
    assert r.headers["retry-after"] == "1"


def _busy(sock: socket.socket) -> socket.socket:
    """A request whose headers are in and whose body never comes: the connection counts
    against the limit (one still sending its headers does not: see test_slow_headers)."""
    sock.sendall(
        b"POST /v1/embed HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n"
    )
    return sock


def test_connections_beyond_the_bound_get_json_503_but_health_routes_answer(live):
    idle = [_connect(live) for _ in range(100)]  # more than the limit, but silent: not counted
    try:
        time.sleep(0.1)
        assert httpx.post(live.url + "/v1/embed", json={"sentences": ["a b"]}).status_code == 200
    finally:
        for sock in idle:
            sock.close()
    socks = [_busy(_connect(live)) for _ in range(64)]
    try:
        time.sleep(0.1)  # well inside the 0.5 s header deadline that will close them
        _overloaded(httpx.post(live.url + "/v1/embed", json={"sentences": ["a b"]}))
        for path in ("/healthz", "/readyz", "/metrics"):  # probes see a live, ready server
            assert httpx.get(live.url + path).status_code == 200, path
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.2)
    assert httpx.post(live.url + "/v1/embed", json={"sentences": ["a b"]}).status_code == 200


def test_idle_sockets_lock_no_one_out_of_a_real_server(tiny_model_dir, tmp_path):
    """1,100 sockets that send nothing (above the default limit of 1,024) against a
    real `elmo-service serve` process: other clients' embeds are answered at once, and the
    server closes the silent sockets after the first-byte deadline (4 s here). No wall-clock
    bound: the embeds are answered while every silent socket is still open (none readable)."""
    from tests.support.replicas import Replica

    env = {"ELMO_MODEL_PATH": str(tiny_model_dir), "ELMO_HTTP_FIRST_BYTE_TIMEOUT": "4"}
    replica = Replica(env, tmp_path, "idle")
    replica.start()
    socks: list[socket.socket] = []
    try:
        replica.wait_ready()
        socks = [socket.create_connection(("127.0.0.1", replica.port)) for _ in range(1100)]
        with httpx.Client(base_url=replica.url, timeout=5) as c:
            for _ in range(5):
                r = c.post("/v1/embed", json={"sentences": ["a b"]})
                assert r.status_code == 200, r.text
            assert c.get("/readyz").status_code == 200
        # nothing came back on any silent socket yet: the embeds did not wait for them to go
        poll = select.poll()  # not select(): fds above 1024
        for sock in socks:
            poll.register(sock, select.POLLIN)
        assert not poll.poll(0), "the embeds waited for the idle sockets to go"
        for sock in socks:  # each is closed by the server: a 408, then EOF
            sock.settimeout(30)  # a deadline, not a timing
            reply = _read_all(sock)
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
        assert b"no request received within 4s" in reply
    finally:
        for sock in socks:
            sock.close()
        replica.stop()


def test_plain_uvicorn_limit_concurrency_gets_the_same_exemptions(tiny_model_dir, tmp_path):
    """``uvicorn --http elmo_api.http_protocol:DeadlineHttpToolsProtocol --limit-concurrency N``."""
    from elmo_api.http_protocol import DeadlineHttpToolsProtocol

    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path)
    app = create_app(s)
    with LiveServer(app, http=DeadlineHttpToolsProtocol, limit_concurrency=8) as srv:
        socks = [_busy(socket.create_connection(("127.0.0.1", srv.port))) for _ in range(8)]
        try:
            time.sleep(0.2)
            _overloaded(httpx.post(srv.url + "/v1/embed", json={"sentences": ["a b"]}))
            assert httpx.get(srv.url + "/healthz").status_code == 200
        finally:
            for sock in socks:
                sock.close()
