"""A request's Python work on the event loop (tokens, cache entries, its answer) runs in turns
of ``TURN_SENTENCES`` sentences, other requests' work between them: a one-sentence request
arriving behind a large one is not held up by all of it (``elmo_api.served.in_turns``)."""

from __future__ import annotations

import asyncio

import httpx

from elmo_api.main import create_app
from elmo_api.served import TURN_SENTENCES, ServedModel, in_turns
from elmo_api.settings import load_settings


def test_two_callers_take_turns_part_by_part():
    order: list[tuple[str, int]] = []

    def work(name: str):
        def fn(part, start):
            order.append((name, start))
            return [x * 10 for x in part]

        return fn

    async def main():
        return await asyncio.gather(
            in_turns(list(range(3 * TURN_SENTENCES)), work("a")),
            in_turns(list(range(2 * TURN_SENTENCES + 1)), work("b")),
        )

    a, b = asyncio.run(main())
    assert a == [x * 10 for x in range(3 * TURN_SENTENCES)]  # every part, in order
    assert b == [x * 10 for x in range(2 * TURN_SENTENCES + 1)]
    t = TURN_SENTENCES
    assert order == [("a", 0), ("b", 0), ("a", t), ("b", t), ("a", 2 * t), ("b", 2 * t)]


def test_a_small_request_is_tokenized_between_the_parts_of_a_large_one(
    tiny_model_dir, tmp_path, monkeypatch
):
    calls: list[tuple[int, int]] = []  # (sentences, offset) of each tokenize call
    real = ServedModel.tokenize

    def spy(self, sentences, field="sentences", offset=0):
        calls.append((len(sentences), offset))
        return real(self, sentences, field, offset)

    monkeypatch.setattr(ServedModel, "tokenize", spy)
    settings = load_settings(model_path=tiny_model_dir, data_dir=tmp_path, threads=1, cache=False)
    app = create_app(settings)
    big = [f"sentence {i} of the large request ." for i in range(32 * TURN_SENTENCES)]
    small = ["the small request ."]

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                body = {"output": "mix", "encoding": "base64"}
                alone = await c.post("/v1/embed", json={"sentences": small, **body})  # warms
                calls.clear()
                large = asyncio.create_task(c.post("/v1/embed", json={"sentences": big, **body}))
                while not calls:  # the large request's first part is tokenized
                    await asyncio.sleep(0)
                one = await c.post("/v1/embed", json={"sentences": small, **body})
                return await large, one, alone

    large, one, alone = asyncio.run(main())
    assert large.status_code == one.status_code == 200, (large.text, one.text)
    big_parts = [c for c in calls if c != (1, 0)]
    assert big_parts == [(TURN_SENTENCES, i) for i in range(0, len(big), TURN_SENTENCES)]
    # the small request's one sentence was tokenized while the large one still had parts left
    assert calls.index((1, 0)) < len(calls) - 1, calls
    # errors and answers keep their place in the whole request
    data = large.json()["data"]
    assert [d["index"] for d in data] == list(range(len(big)))
    assert data[-1]["tokens"][0]["text"].endswith("sentence")
    assert one.json()["data"] == alone.json()["data"]  # the same vectors as alone
