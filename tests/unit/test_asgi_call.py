import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from services.replica.asgi_call import ResponseStart, stream_asgi


def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()

        async def chunks():
            try:
                for i in range(50):
                    yield f"data: {i} {body.decode()}\n\n"
                    await asyncio.sleep(0.01)
                events.append("finished")
            except asyncio.CancelledError:
                events.append("cancelled")
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream", headers={"x-path": request.url.path})

    return app


def test_streams_start_then_chunks() -> None:
    events: list[str] = []

    async def collect():
        return [item async for item in stream_asgi(_app(events), "POST", "/echo", b"hi", {})]

    items = asyncio.run(collect())
    assert isinstance(items[0], ResponseStart)
    assert items[0].status == 200
    assert items[0].header("x-path") == "/echo"
    assert items[1] == b"data: 0 hi\n\n"
    assert len(items) == 51
    assert events == ["finished"]


def test_closing_early_cancels_the_app() -> None:
    events: list[str] = []

    async def read_two():
        stream = stream_asgi(_app(events), "POST", "/echo", b"x", {})
        assert isinstance(await anext(stream), ResponseStart)
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.1)

    asyncio.run(read_two())
    assert events == ["cancelled"]


def test_unknown_path_is_a_404_not_a_hang() -> None:
    async def collect():
        return [item async for item in stream_asgi(_app([]), "POST", "/nope", b"", {})]

    items = asyncio.run(asyncio.wait_for(collect(), 5))
    assert items[0].status == 404
