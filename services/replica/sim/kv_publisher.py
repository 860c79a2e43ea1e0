"""A simulated engine's KV events on ZMQ, as vLLM's `ZmqEventPublisher` sends them, without its thread: every
publisher of the process shares one asyncio loop and one ZMQ context (one I/O thread, however many engines).

- PUB socket: each batch as (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`), numbers from 0,
  the batch stamped with the wall-clock time and data-parallel rank 0.
- ROUTER replay socket: a request (identity, b"", 8-byte start number) gets every buffered batch numbered from the
  start on as (identity, b"", topic, number, payload), then the end marker (identity, b"", b"", -1, b""). A request
  of another shape is ignored, as vLLM does.
- The last `buffer_steps` batches are buffered (vLLM's default 10,000).

Both sockets bind a port the kernel picks on `host`. A send never waits: a PUB socket drops what a slow subscriber
cannot take (past its high-water mark, vLLM's 100,000), and a ROUTER drops what an unreachable peer cannot.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from itertools import count

import msgspec
import zmq
import zmq.asyncio

from services.replica.sim.kv_events_wire import KVCacheEvent, KVEventBatch

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# vLLM's publisher defaults (`KVEventsConfig`).
BUFFER_STEPS = 10_000
HWM = 100_000


class SimKVPublisher:
    """One engine's publisher; `start` it on the running loop, then `publish` each step's events."""

    def __init__(
        self, topic: str = "", buffer_steps: int = BUFFER_STEPS, context: zmq.asyncio.Context | None = None
    ) -> None:
        self.topic = topic
        self.endpoint = ""
        self.replay_endpoint = ""
        self._topic = topic.encode()
        self._context = context or zmq.asyncio.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._numbers = count()
        self._encoder = msgspec.msgpack.Encoder()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    async def start(self, host: str = "127.0.0.1") -> None:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(HWM)
        self._pub.bind(f"tcp://{host}:0")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.bind(f"tcp://{host}:0")
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replays(self._replay))

    def publish(self, events: list[KVCacheEvent]) -> None:
        if self._pub is None:
            raise RuntimeError("publisher not started, or closed")
        number = next(self._numbers)
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        # DONTWAIT: the send completes (or fails) now, so its future is done and read at once.
        self._pub.send_multipart((self._topic, number.to_bytes(8, "big"), payload), flags=zmq.DONTWAIT).result()
        self._buffer.append((number, payload))

    async def _serve_replays(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                continue
            identity, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            # A copy: batches published while the replies are sent must not change what is iterated.
            for number, payload in list(self._buffer):
                if number >= start:
                    await replay.send_multipart((identity, b"", self._topic, number.to_bytes(8, "big"), payload))
            await replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
