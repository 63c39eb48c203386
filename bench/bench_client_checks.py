"""What checking every answer costs the client (#50 item 2), against decoding it unchecked.

One chunk's answer as ``POST /v1/embed`` sends it (``--sentences`` sentences of ``--tokens``
tokens, ``[3, T, 256]`` base64 float32 layers), decoded two ways, interleaved:

  unchecked -- what the client did before: tokens, base64 -> numpy -> reshape, per sentence;
  checked   -- ``elmo_client.answers.check_embed``: the same decode plus count, order,
               dtype, the data's length against ``shape``, shapes against T, finite values,
               the header against the body.

Prints the median time per chunk of each and their ratio, with the CPU and load.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_client_checks.py
"""

from __future__ import annotations

import argparse
import base64
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "clients" / "python"))

from elmo_client.answers import Expect, check_embed  # noqa: E402
from elmo_client.shared import EmbeddedSentence, Token  # noqa: E402
from elmo_client.wire import Reply  # noqa: E402


def answer(n: int, t: int, dim: int) -> tuple[bytes, list[str]]:
    rng = np.random.default_rng(0)
    sentences, data = [], []
    for i in range(n):
        words = [f"w{j}" for j in range(t)]
        text = " ".join(words)
        sentences.append(text)
        toks, pos = [], 0
        for j, w in enumerate(words):
            toks.append({"text": w, "start": pos, "end": pos + len(w), "word": j})
            pos += len(w) + 1
        x = rng.standard_normal((3, t, dim)).astype("<f4")
        data.append({"index": i, "tokens": toks, "layers": {
            "shape": [3, t, dim], "dtype": "float32",
            "data": base64.b64encode(x.tobytes()).decode(), "indices": [0, 1, 2]}})  # fmt: skip
    body = {"object": "embed_result", "model": {"id": "m", "version": "v"}, "data": data}
    return orjson.dumps(body), sentences


def unchecked(content: bytes) -> list:
    """The client before #50: tokens and arrays decoded as they came."""
    body = orjson.loads(content)
    out = []
    for d in body["data"]:
        a = d["layers"]
        raw = np.frombuffer(base64.b64decode(a["data"]), np.dtype(a["dtype"]).newbyteorder("<"))
        tokens = [Token(t["text"], t["start"], t["end"], t["word"]) for t in d["tokens"]]
        out.append(EmbeddedSentence(tokens, raw.astype(np.float32).reshape(a["shape"])))
    return out


def checked(content: bytes, sentences: list[str]) -> list:
    reply = Reply(200, {"x-model-version": "v"}, content, "http://h/v1/embed")
    expect = Expect("token", "layers", False)
    return check_embed(orjson.loads(content), reply, sentences, expect).sentences


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=200)
    a = p.parse_args()
    content, sentences = answer(a.sentences, a.tokens, a.dim)
    times: dict[str, list[float]] = {"unchecked": [], "checked": []}
    for _ in range(a.rounds):  # interleaved, so load changes hit both alike
        for name in times:
            t0 = time.perf_counter()
            unchecked(content) if name == "unchecked" else checked(content, sentences)
            times[name].append(time.perf_counter() - t0)
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    print(f"cpu: {cpu}; load: {os.getloadavg()[0]:.1f}; numpy {np.__version__}")
    print(f"chunk: {a.sentences} sentences x {a.tokens} tokens x [3, T, {a.dim}] float32, "
          f"{len(content) / 1e6:.2f} MB of JSON")  # fmt: skip
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>9}: {v:.3f} ms per chunk (median of {a.rounds})")
    print(f"checked / unchecked: {med['checked'] / med['unchecked']:.2f}x")


if __name__ == "__main__":
    main()
