"""A real HTTP server process that forwards to a real ``elmo-service`` and mangles its answers.

``python -m tests.support.lying_server --upstream URL --port P``: a request for
``/<mode>/v1/...`` is forwarded to ``URL/v1/...`` and the answer of ``/v1/embed`` comes
back mangled as ``mode`` says (a client pointed at ``http://127.0.0.1:P/<mode>``), one
way for each kind of mangled answer a client must refuse:

drop      one sentence of each answer left out          extra    one sentence twice
reverse   the sentences in reverse order                 float64  data relabelled float64
transpose a [K, T, D] shape written [K, D, T]            nan      a NaN in the layers
inf       an infinity in the layers                      header   X-Model-Version another's
short     tokens one shorter than the layers             json     the body cut short
nokey     the answer without its ``model``              honest   the answer as it came

Every other route is forwarded unchanged.
"""

from __future__ import annotations

import argparse
import base64
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np

MODES = ("drop", "extra", "reverse", "float64", "transpose", "nan", "inf", "header", "short",
         "json", "nokey", "honest")  # fmt: skip


def _poison(arr: dict[str, Any], value: float) -> None:
    x = np.frombuffer(base64.b64decode(arr["data"]), "<f4").copy()
    x[len(x) // 2] = value
    arr["data"] = base64.b64encode(x.tobytes()).decode()


def mangle(mode: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    data = body["data"]
    if mode == "drop":
        del data[len(data) // 2]
    elif mode == "extra":
        data.append(dict(data[-1]))
    elif mode == "reverse":
        data.reverse()
    elif mode == "float64":
        for d in data:
            d["layers"]["dtype"] = "float64"
    elif mode == "transpose":
        for d in data:
            k, t, dim = d["layers"]["shape"]
            d["layers"]["shape"] = [k, dim, t]
    elif mode in ("nan", "inf"):
        _poison(data[-1]["layers"], float(mode))
    elif mode == "header":
        headers["X-Model-Version"] = "0" * 16
    elif mode == "short":
        d = max(data, key=lambda d: len(d["tokens"]))
        d["tokens"].pop()
    elif mode == "nokey":
        del body["model"]
    out = json.dumps(body).encode()
    return out[: len(out) // 2] if mode == "json" else out


def serve(upstream: str, port: int) -> None:
    http = httpx.Client(base_url=upstream, timeout=120)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _handle(self) -> None:
            _, mode, rest = self.path.split("/", 2)
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else None
            fwd = {k: v for k, v in self.headers.items() if k.lower() in
                   ("authorization", "content-type", "accept")}  # fmt: skip
            r = http.request(self.command, "/" + rest, content=raw, headers=fwd)
            headers = {k: v for k, v in r.headers.items() if k.lower() in
                       ("content-type", "x-model-version", "retry-after")}  # fmt: skip
            content = r.content
            if rest.startswith("v1/embed") and r.status_code == 200 and mode != "honest":
                content = mangle(mode, r.json(), headers)
            self.send_response(r.status_code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = do_PUT = do_DELETE = _handle

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    serve(a.upstream, a.port)
