"""A model request whose client hangs up stops waiting (api/hangup.py)."""

from __future__ import annotations

import asyncio

from freetoken.api.hangup import CancelOnHangup


def _client(*messages):
    """An ASGI receive that hands out `messages`, then waits forever (a client still there)."""
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.Event().wait()

    return receive


def _scope(path="/api/chat"):
    return {"type": "http", "method": "POST", "path": path, "headers": []}


def test_a_handler_waiting_when_its_client_hangs_up_is_cancelled():
    seen = {}

    async def handler(scope, receive, send):
        seen["body"] = (await receive())["body"]
        try:
            await asyncio.Event().wait()  # waiting for a model that loads for others
        finally:
            seen["cleaned up"] = True

    async def main():
        body = {"type": "http.request", "body": b"{}", "more_body": False}
        hangup = {"type": "http.disconnect"}
        app = CancelOnHangup(handler)
        await asyncio.wait_for(app(_scope(), _client(body, hangup), lambda m: None), 5)

    asyncio.run(main())
    assert seen == {"body": b"{}", "cleaned up": True}


def test_a_client_that_stays_gets_its_whole_answer():
    sent = []

    async def handler(scope, receive, send):
        await receive()
        await asyncio.sleep(0.05)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message):
        sent.append(message)

    async def main():
        body = {"type": "http.request", "body": b"{}", "more_body": False}
        await CancelOnHangup(handler)(_scope(), _client(body), send)

    asyncio.run(main())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_the_watch_never_takes_a_part_of_the_body():
    parts = []

    async def handler(scope, receive, send):
        await asyncio.sleep(0.05)  # reads late: the watch must not have read ahead
        while True:
            message = await receive()
            parts.append(message["body"])
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def main():
        chunks = [
            {"type": "http.request", "body": b"a", "more_body": True},
            {"type": "http.request", "body": b"b", "more_body": False},
        ]
        await CancelOnHangup(handler)(_scope(), _client(*chunks), _noop)

    asyncio.run(main())
    assert parts == [b"a", b"b"]


def test_other_routes_get_the_server_s_own_receive():
    given = {}
    receive = _client()

    async def handler(scope, rcv, send):
        given["receive"] = rcv

    asyncio.run(CancelOnHangup(handler)(_scope("/api/pull"), receive, _noop))
    assert given["receive"] is receive  # a pull's upload and progress stream are untouched


async def _noop(message):
    return None
