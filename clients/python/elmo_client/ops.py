"""Every client operation, written once as a generator over ``wire``'s requests.

``Client`` runs these with threads, ``AsyncClient`` with asyncio; the namespaces
(``client.tasks``, ``client.models``, ``client.jobs``) hand each generator to their
client's runner, so ``client.tasks.get("pos")`` returns the task and
``await aclient.tasks.get("pos")`` the same.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any
from urllib.parse import quote

from elmo_service.client.errors import JobFailed, ServiceError
from elmo_service.client.wire import (
    Call,
    Limits,
    Many,
    Sleep,
    check_sentences,
    decode_sentence,
    embed_body,
    floats_per_position,
    plan_chunks,
    shift_error,
)
from elmo_service.errors import InputError

Op = Generator[Any, Any, Any]
TERMINAL = ("succeeded", "failed", "cancelled")


class Session:
    """What a client remembers between calls: the server's limits (read once)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.limits: Limits | None = None


def limits(session: Session, refresh: bool = False) -> Op:
    if session.limits is None or refresh:
        session.limits = Limits.from_json((yield Call("GET", "/v1/limits")))
    return session.limits


class EmbedResult(list):
    """``EmbeddedSentence`` per input sentence, in order, and the model that computed
    them: ``model`` ``{"id", "version"}`` and ``model_version``."""

    model: dict[str, str]

    @property
    def model_version(self) -> str | None:
        return self.model.get("version")


def embed(
    session: Session,
    sentences: Sequence[str | Sequence[str]],
    *,
    mix: Any = None,
    granularity: str = "token",
    output: str | None = None,
    pooling: str = "none",
) -> Op:
    """``Embedder.embed`` over HTTP: split under the server's limits, sent concurrently,
    reassembled in order. Every sentence comes from one model version: chunks answered by
    an older one (a model swapped mid-call) are asked again, once."""
    sentences = list(sentences)
    check_sentences(sentences)
    result = EmbedResult()
    if not sentences:
        result.model = {}
        return result
    lim = yield from limits(session)
    per_position = floats_per_position(mix, output, lim)
    chunks = plan_chunks(
        sentences,
        lim,
        batch_size=session.batch_size,
        floats_per_position=per_position,
        pooled=pooling != "none",
    )
    answers: dict[tuple[int, int], dict[str, Any]] = {}
    for _ in range(2):
        answers.update(
            (yield from _send_chunks(sentences, chunks, mix, output, granularity, pooling))
        )
        versions = {a["model"]["version"] for a in answers.values()}
        if len(versions) == 1:
            break
        now = (yield Call("GET", "/v1/limits"))["model"]["version"]  # the one served now
        chunks = [k for k, a in answers.items() if a["model"]["version"] != now]
        for k in chunks:  # asked again (and maybe split again): their old answers go
            del answers[k]
    else:
        raise ServiceError(
            409, "model_changed", f"the served model changed twice during one call ({sorted(versions)})",
            None, "/v1/embed",
        )  # fmt: skip
    for key in sorted(answers):
        result.extend(answers[key]["sentences"])
    result.model = next(iter(answers.values()))["model"]
    return result


def _decode(answer: dict[str, Any], granularity: str) -> dict[str, Any]:
    """An embed answer's model and its sentences as the library's ``EmbeddedSentence``."""
    from elmo_service.embedder import EmbeddedSentence  # the library's type (pulls in torch)
    from elmo_service.tokenizers import Token

    sentences = [decode_sentence(d, granularity, Token, EmbeddedSentence) for d in answer["data"]]
    return {"model": answer["model"], "sentences": sentences}


def _send_chunks(sentences, chunks, mix, output, granularity, pooling) -> Op:
    """``{(start, end): answer}`` for these chunks; one whose answer would be too large is
    split in two and sent again; the first other error (in input order) is raised."""
    done: dict[tuple[int, int], dict[str, Any]] = {}
    todo = list(chunks)
    while todo:
        calls = [
            Call(
                "POST",
                "/v1/embed",
                embed_body(
                    sentences[a:b], mix=mix, output=output, granularity=granularity, pooling=pooling
                ),
                parse=functools.partial(_decode, granularity=granularity),
            )
            for a, b in todo
        ]
        answers = yield Many(calls)
        again = []
        for (a, b), ans in zip(todo, answers, strict=True):
            if isinstance(ans, ServiceError) and ans.code == "response_too_large" and b - a > 1:
                mid = (a + b) // 2
                again += [(a, mid), (mid, b)]
            elif isinstance(ans, BaseException):
                raise shift_error(ans, a) if isinstance(ans, ServiceError) else ans
            elif ans is not None:
                done[(a, b)] = ans
        if any(ans is None for ans in answers):  # stopped by an error raised above
            raise RuntimeError("unreachable: requests were stopped without an error")
        todo = again
    return done


def one(call: Call, pick: Callable[[Any], Any] | None = None) -> Op:
    body = yield call
    return pick(body) if pick else body


def _path(*parts: str) -> str:
    return "/".join(quote(p, safe="") for p in parts)


class Tasks:
    """``/v1/tasks``: task mixes (writes need an admin key)."""

    def __init__(self, run: Callable[[Op], Any]) -> None:
        self._run = run

    def list(self):
        """The tasks (each ``{name, weights, gamma, per_direction, layer_norm, meta, source, ...}``)."""
        return self._run(one(Call("GET", "/v1/tasks"), lambda b: b["data"]))

    def get(self, name: str):
        return self._run(one(Call("GET", f"/v1/tasks/{_path(name)}")))

    def put(self, name: str, spec: Any):
        """Store a task: a ``MixSpec`` or its dict (``weights``, ``gamma``, ...)."""
        body = spec if isinstance(spec, dict) else spec.to_dict()
        return self._run(one(Call("PUT", f"/v1/tasks/{_path(name)}", body)))

    def delete(self, name: str):
        return self._run(one(Call("DELETE", f"/v1/tasks/{_path(name)}")))


class Models:
    """``/v1/models``: what is served, the artifacts, the fleet; activation (admin)."""

    def __init__(self, run: Callable[[Op], Any]) -> None:
        self._run = run

    def list(self, full: bool = False):
        """The whole answer: ``data`` (the served model), ``served``, ``artifacts``, ``fleet``."""
        params = {"full": "true"} if full else None
        return self._run(one(Call("GET", "/v1/models", params=params)))

    def get(self, model_id: str):
        return self._run(one(Call("GET", f"/v1/models/{_path(model_id)}")))

    def activate(self, name: str):
        """Serve another artifact of the models folder (with Redis: on every replica)."""
        return self._run(one(Call("POST", f"/v1/models/{_path(name)}/activate")))

    def fleet(self):
        """Which replica serves what, and whether they agree."""
        return self._run(one(Call("GET", "/v1/models"), lambda b: b["fleet"]))


def _job_id(job: str | dict[str, Any]) -> str:
    return job if isinstance(job, str) else job["id"]


class Jobs:
    """``/v1/jobs``: pretraining jobs (admin key)."""

    def __init__(self, run: Callable[[Op], Any]) -> None:
        self._run = run

    def submit(self, spec: dict[str, Any]):
        """Queue a job (``{"corpus", "config", "budget", "prepare", "name"}``): its record."""
        return self._run(one(Call("POST", "/v1/jobs", spec)))

    def get(self, job: str | dict[str, Any]):
        return self._run(one(Call("GET", f"/v1/jobs/{_path(_job_id(job))}")))

    def list(self, state: str | None = None, limit: int = 100):
        params = {"limit": limit, **({"state": state} if state else {})}
        return self._run(one(Call("GET", "/v1/jobs", params=params), lambda b: b["data"]))

    def cancel(self, job: str | dict[str, Any]):
        return self._run(one(Call("POST", f"/v1/jobs/{_path(_job_id(job))}/cancel")))

    def retry(self, job: str | dict[str, Any]):
        return self._run(one(Call("POST", f"/v1/jobs/{_path(_job_id(job))}/retry")))

    def wait(
        self,
        job: str | dict[str, Any],
        *,
        progress: bool = True,
        poll: float = 1.0,
        timeout: float | None = None,
    ):
        """Poll until the job ends: its record when it succeeded (``artifact`` names the
        model), :class:`JobFailed` when it failed or was cancelled. ``progress``: a tqdm
        bar of its steps, with the loss."""
        return self._run(_wait(_job_id(job), progress, poll, timeout))


def _wait(job_id: str, progress: bool, poll: float, timeout: float | None) -> Op:
    if poll <= 0:
        raise InputError("poll must be > 0 seconds", field="poll")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc=f"job {job_id}", unit="step")
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            rec = yield Call("GET", f"/v1/jobs/{_path(job_id)}")
            if bar is not None:
                _show(bar, rec)
            if rec["state"] in TERMINAL:
                if rec["state"] != "succeeded":
                    raise JobFailed(rec)
                return rec
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {rec['state']} after {timeout:g}s")
            yield Sleep(poll)
    finally:
        if bar is not None:
            bar.close()


def _show(bar: Any, rec: dict[str, Any]) -> None:
    p = rec.get("progress") or {}
    if p.get("total_steps") and bar.total != p["total_steps"]:
        bar.total = p["total_steps"]
    step = int(p.get("step") or 0)
    if step > bar.n:
        bar.update(step - bar.n)
    post = {"state": rec["state"]}
    if rec.get("phase"):
        post["phase"] = rec["phase"]
    if p.get("loss") is not None:
        post["loss"] = f"{p['loss']:.4g}"
    bar.set_postfix(post, refresh=True)
