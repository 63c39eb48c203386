"""Every client operation, written once as a generator over ``wire``'s requests.

``Client`` runs these with threads, ``AsyncClient`` with asyncio; the namespaces
(``client.tasks``, ``client.models``, ``client.jobs``) hand each generator to their
client's runner, so ``client.tasks.get("pos")`` returns the task and
``await aclient.tasks.get("pos")`` the same.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import Any
from urllib.parse import quote

from elmo_client.answers import ChunkAnswer, Expect, check_embed, empty_sentence
from elmo_client.errors import JobFailed, ServiceError, ServiceUnreachable
from elmo_client.shared import InputError
from elmo_client.wire import (
    Call,
    Limits,
    Many,
    RetryPolicy,
    Sleep,
    check_priority,
    check_sentences,
    embed_body,
    floats_per_position,
    is_empty,
    mix_spec,
    plan_chunks,
    shift_error,
)

Op = Generator[Any, Any, Any]
TERMINAL = ("succeeded", "failed", "cancelled")


class Session:
    """What a client remembers between calls: the server's limits (read once), whether it
    knows ``priority`` (an older server refuses the field: then it is not sent), the retry
    rule and the URL errors name."""

    def __init__(self, batch_size: int, retry: RetryPolicy | None = None, url: str = "") -> None:
        self.batch_size = batch_size
        self.limits: Limits | None = None
        self.lanes: bool | None = None  # whether the server knows ``priority`` (None: not yet)
        self.retry = retry or RetryPolicy()
        self.url = url


def limits(session: Session, refresh: bool = False) -> Op:
    if session.limits is None or refresh:
        session.limits = yield Call("GET", "/v1/limits", parse=_limits)
    return session.limits


def _limits(body: Any, reply: Any) -> Limits:
    return Limits.from_json(body)


class EmbedResult(list):
    """``EmbeddedSentence`` per input sentence, in order, and the model that computed
    them: ``model`` ``{"id", "version"}`` and ``model_version``; ``timings``: the server's
    timing headers summed over the call's requests (milliseconds: ``total``,
    ``tokenization``, ``queue``, ``inference``; empty from a server that sends none),
    ``chunk_timings`` each request's, in input order; ``requests``: how many were sent."""

    model: dict[str, str]
    timings: dict[str, float]
    chunk_timings: list[dict[str, float]]
    requests: int

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.model, self.timings, self.chunk_timings, self.requests = {}, {}, [], 0

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
    priority: str | None = None,
    model_version: str | None = None,
) -> Op:
    """``Embedder.embed`` over HTTP: split under the server's limits, sent concurrently,
    checked, reassembled in order. Every sentence comes from one model version (see
    :func:`_one_version`); an empty sentence gets the library's empty answer, unsent."""
    sentences = list(sentences)
    check_sentences(sentences)
    check_priority(priority)
    if mix is not None and not isinstance(mix, str):
        mix_spec(mix)  # a bad mix is the caller's ValueError, before any request
    result = EmbedResult()
    if not sentences:
        return result
    lim = yield from limits(session)
    expect = Expect.of(mix=mix, output=output, granularity=granularity, pooling=pooling)
    sent = [i for i, s in enumerate(sentences) if not is_empty(s)]
    texts = [sentences[i] for i in sent]
    chunks = plan_chunks(
        texts,
        lim,
        batch_size=session.batch_size,
        floats_per_position=floats_per_position(mix, output, lim),
        pooled=expect.pooled,
    )
    # a call split in several requests is bulk work unless the caller says otherwise
    lane = priority or ("batch" if len(chunks) > 1 else None)
    count = [0]  # requests sent
    send = functools.partial(
        _send_chunks, session, texts, sent, expect,
        dict(mix=mix, output=output, granularity=granularity, pooling=pooling),
        lane, priority is not None, count,
    )  # fmt: skip
    answers = (yield from _one_version(session, send, chunks, model_version)) if chunks else {}
    by_sentence: dict[int, Any] = {}
    for (a, b), ans in sorted(answers.items()):
        by_sentence.update(zip(sent[a:b], ans.sentences, strict=True))
        result.chunk_timings.append(ans.timings)
        for k, v in ans.timings.items():
            result.timings[k] = result.timings.get(k, 0.0) + v
    result.requests = count[0]
    if answers:
        result.model = next(iter(answers.values())).model
    else:  # every sentence empty: nothing sent; the served model's shape and name
        result.model = dict(lim.model)
    if len(by_sentence) != len(sent):  # a sentence never answered is never filled in
        raise RuntimeError(f"{len(sent) - len(by_sentence)} sentences were not answered")
    k, dim = _shape_of(answers, lim)
    result.extend(
        by_sentence[i] if i in by_sentence else empty_sentence(expect, k, dim)
        for i in range(len(sentences))
    )
    return result


def _shape_of(answers: dict[Any, ChunkAnswer], lim: Limits) -> tuple[int, int]:
    """(K layers, width D) of the answers (their model's), else of the served model."""
    for ans in answers.values():
        for s in ans.sentences:
            ref = s.layers if s.layers is not None else s.mix
            return (len(s.layers) if s.layers is not None else lim.n_layers), ref.shape[-1]
    return lim.n_layers, lim.dim


def _one_version(session: Session, send, chunks, pinned: str | None) -> Op:
    """``{(start, end): ChunkAnswer}`` all from one model version: ``pinned`` when the
    caller names one, else the one the fleet is converging on (its ``desired`` model in
    ``GET /v1/models``), else the version most of the latest requests came back from.
    Chunks from any other version are asked again (a rollout in progress; a split fleet
    where one replica keeps the old model) after short pauses, until every
    chunk agrees or the retry deadline passes: then one ``model_changed`` error saying
    which versions answered how many chunks."""
    answers: dict[tuple[int, int], ChunkAnswer] = {}
    todo, rounds, started = list(chunks), 0, time.monotonic()
    history: list[Counter] = []
    while True:
        latest = yield from send(todo)
        answers.update(latest)
        history.append(Counter(a.version for a in latest.values()))
        seen = Counter(a.version for a in answers.values())
        want = pinned
        if want is None and len(seen) > 1:
            want = (yield from _fleet_version(seen)) or _majority(history, seen)
        if want is None or set(seen) == {want}:
            return answers
        elapsed = time.monotonic() - started
        # a short pause: replicas converge within their fleet interval, and a balancer
        # sends the next request elsewhere; the retry deadline bounds the whole wait
        pause = min(1.0, 0.05 * 2**rounds) * (1 + session.retry.rng.random())
        wait = pause if elapsed + pause <= session.retry.deadline else None
        if wait is None:
            raise ServiceError(
                409, "model_changed",
                f"no single model version answered every chunk in {elapsed:.1f}s "
                f"({rounds + 1} rounds): "
                + ", ".join(f"{v} answered {n} of {len(answers)} chunks" for v, n in seen.most_common())
                + f"; wanted {want}" + (" (pinned by model_version)" if pinned else ""),
                None, session.url + "/v1/embed",
            )  # fmt: skip
        todo = [key for key, a in answers.items() if a.version != want]
        for key in todo:  # asked again (and maybe split again): their old answers go
            del answers[key]
        rounds += 1
        yield Sleep(wait)


def _fleet_version(seen: Counter) -> Op:
    """The fleet's desired version, if the fleet view names one among ``seen`` (else None:
    a server without a fleet, or one converging on a model no chunk has come from)."""
    try:
        body = yield Call("GET", "/v1/models")
        desired = body["fleet"]["desired"]
        version = desired.get("version") if isinstance(desired, dict) else None
    except (ServiceError, ServiceUnreachable, KeyError, TypeError):
        return None
    return version if version in seen else None


def _majority(history: list[Counter], seen: Counter) -> str:
    """The version most answers of the latest round came from; a tie goes to the rounds
    before it, then to all answers, then to the name (a rule, not a coin)."""
    for counts in [*reversed(history), seen]:
        top = counts.most_common()
        if top and (len(top) == 1 or top[0][1] > top[1][1]):
            return top[0][0]
    return max(seen, key=lambda v: (seen[v], v))


def _send_chunks(
    session: Session,
    texts: list,
    positions: list[int],
    expect: Expect,
    options: dict[str, Any],
    lane: str | None,
    explicit: bool,
    count: list[int],
    chunks: list[tuple[int, int]],
) -> Op:
    """``{(start, end): ChunkAnswer}`` for these chunks of ``texts``; one whose answer would
    be too large is split in two and sent again; the first other error (in input order) is
    raised, naming the sentence by its ``positions`` in the caller's input."""
    done: dict[tuple[int, int], ChunkAnswer] = {}
    todo = list(chunks)
    while todo:
        prio = lane if session.lanes is not False or explicit else None
        # whether the server knows ``priority`` is learnt from one request, not from every
        # request of a large call (an older server refuses the field: then it is dropped)
        probe = prio is not None and session.lanes is None and not explicit and len(todo) > 1
        todo, later = (todo[:1], todo[1:]) if probe else (todo, [])
        calls = [
            Call(
                "POST",
                "/v1/embed",
                embed_body(texts[a:b], priority=prio, **options),
                parse=functools.partial(_parse_chunk, texts[a:b], expect),
            )
            for a, b in todo
        ]
        answers = yield Many(calls)
        count[0] += sum(ans is not None for ans in answers)
        again = []
        for (a, b), ans in zip(todo, answers, strict=True):
            if isinstance(ans, ServiceError) and ans.code == "response_too_large" and b - a > 1:
                mid = (a + b) // 2
                again += [(a, mid), (mid, b)]
            elif _no_lanes(ans, prio, explicit):  # an older server: the field is dropped
                session.lanes = False
                again.append((a, b))
            elif isinstance(ans, BaseException):
                raise (
                    shift_error(ans, lambda k, a=a: positions[a + k])
                    if isinstance(ans, ServiceError)
                    else ans
                )
            elif ans is not None:
                done[(a, b)] = ans
                if prio is not None and session.lanes is None:
                    session.lanes = True
            else:  # never sent: another answer stopped the rest (one to split, or lanes)
                again.append((a, b))
        if len(again) == sum(ans is None for ans in answers) and again:
            raise RuntimeError("unreachable: requests were stopped without an error")
        todo = again + later
    return done


def _no_lanes(ans: Any, prio: str | None, explicit: bool) -> bool:
    return (
        isinstance(ans, ServiceError)
        and ans.status == 422
        and ans.field == "priority"
        and prio is not None
        and not explicit
    )


def _parse_chunk(texts: list, expect: Expect, body: Any, reply: Any) -> ChunkAnswer:
    return check_embed(body, reply, texts, expect)


def one(call: Call, pick: Callable[[Any], Any] | None = None) -> Op:
    """One request; ``pick`` takes what the caller wants from the answer (a malformed
    answer is then one ServiceError naming the URL, not a KeyError)."""
    if pick is not None:
        call = Call(call.method, call.path, call.json, call.params,
                    lambda body, reply: pick(body), call.idempotent)  # fmt: skip
    return (yield call)


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
        """Store a task: a list of layer weights, a dict (``weights``, ``gamma``,
        ``per_direction``, ``layer_norm``, and ``meta``), or a ``MixSpec``."""
        meta = spec.get("meta") if isinstance(spec, dict) else getattr(spec, "meta", None)
        mix = {k: v for k, v in spec.items() if k != "meta"} if isinstance(spec, dict) else spec
        body: dict[str, Any] = mix_spec(mix, field="spec")
        if meta:
            body["meta"] = meta
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
        return self._run(one(Call("POST", "/v1/jobs", spec, idempotent=False)))

    def get(self, job: str | dict[str, Any]):
        return self._run(one(Call("GET", f"/v1/jobs/{_path(_job_id(job))}")))

    def list(self, state: str | None = None, limit: int = 100):
        params = {"limit": limit, **({"state": state} if state else {})}
        return self._run(one(Call("GET", "/v1/jobs", params=params), lambda b: b["data"]))

    def cancel(self, job: str | dict[str, Any]):
        return self._run(one(Call("POST", f"/v1/jobs/{_path(_job_id(job))}/cancel")))

    def retry(self, job: str | dict[str, Any]):
        # a new attempt of the job each time: never sent twice on a doubtful failure
        call = Call("POST", f"/v1/jobs/{_path(_job_id(job))}/retry", idempotent=False)
        return self._run(one(call))

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
        try:
            from tqdm.auto import tqdm
        except ImportError:  # not a dependency of the client: no bar without it
            tqdm = None
        if tqdm is not None:
            bar = tqdm(desc=f"job {job_id}", unit="step")
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            rec = yield Call("GET", f"/v1/jobs/{_path(job_id)}", parse=_record)
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


def _record(body: Any, reply: Any) -> dict[str, Any]:
    """A job's record, which must at least say its state (else one ServiceError)."""
    if not isinstance(body, dict) or not isinstance(body.get("state"), str):
        raise ValueError("the answer is not a job record with a state")
    return body


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
