"""``FaultProxy``: a FAKE for fault injection, in front of the real vLLM server.

It forwards everything to the real server and, on chat-completion requests,
injects what a production network and server do to a long generation run:
5xx answers, connection resets, slow responses, a renamed or missing reasoning
field (also for samples only, sparing the pre-flight's canary: the client that
"misses the field after the canary" of the story), malformed JSON, chosen status codes for chosen samples, a server
that goes away, and requests held unanswered until the test releases them
(``hold_after``, :meth:`FaultProxy.release`: an event the test controls instead of a delay). It counts chat-completion requests per sample id (the client
names the sample in the ``X-Eagle3-Sample-Id`` header), which is how the tests
prove that a resumed shard does not ask again for what was already durable.

It can also pace the answers (``pace``: ``(concurrency, samples)``) to
observe a client's requests in flight: sample requests are forwarded as they
come, and their answers are returned one at a time, in the order the requests
arrived, each only once ``concurrency`` sample requests are in flight (or once
all ``samples`` have arrived: nothing more can come). A client that keeps its
budget full sends its next request as each answer lands, so every answer goes
back at ``concurrency`` in flight; one that lets the count fall while work
remains (drains between shards) leaves the proxy waiting: after
``pace_timeout_s`` it answers anyway and records that answer as returned below
``concurrency``. :meth:`FaultProxy.paced` lists every answer with the count.

Faults are drawn deterministically from (seed, sample id, n-th request of that
id), so a test sees the same faults on every run, and a retried request draws
afresh (it can succeed).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping

import aiohttp
from aiohttp import web

from eagle3_assets.core.generation.completions import CANARY_ID, SAMPLE_ID_HEADER

FAULT_KINDS = ("5xx", "reset", "slow")
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultProxy:
    """A reverse proxy (aiohttp, own thread and event loop) on a loopback port; use as a context manager."""

    def __init__(
        self,
        upstream: str,
        *,
        fault_rate: float = 0.0,
        fault_kinds: Iterable[str] = FAULT_KINDS,
        slow_s: float = 1.0,
        delay_s: float = 0.0,
        tokenize_delay_s: float = 0.0,
        rename_reasoning: bool = False,
        drop_reasoning: bool = False,
        drop_reasoning_share: float = 0.0,
        spare_canary: bool = False,
        malformed_ids: Iterable[str] = (),
        status_for_ids: Mapping[str, int] | None = None,
        unavailable_after: int | None = None,
        hold_after: int | None = None,
        pace: tuple[int, int] | None = None,
        pace_timeout_s: float = 10.0,
        seed: int = 0,
    ):
        self.upstream = upstream.rstrip("/")
        self.fault_rate = fault_rate
        self.fault_kinds = tuple(fault_kinds)
        self.slow_s = slow_s
        self.delay_s = delay_s
        self.tokenize_delay_s = tokenize_delay_s  # a /tokenize that hangs
        self.rename_reasoning = rename_reasoning
        self.drop_reasoning = drop_reasoning
        # Drop the reasoning of this share of the samples only, each drawn from (seed, sample id): some rows good, some bad.
        self.drop_reasoning_share = drop_reasoning_share
        self.spare_canary = spare_canary  # the canary's response passes untouched: the fault hits the samples only
        self.malformed_ids = set(malformed_ids)
        self.status_for_ids = dict(status_for_ids or {})
        self.unavailable_after = unavailable_after  # answer 503 to every chat request after this many
        # Pass this many sample requests (the canary always passes), then hold every later one, unanswered and not
        # forwarded, until release(): the test, not the machine's speed, decides when the server gets to answer.
        self.hold_after = hold_after
        self._samples_seen = 0
        self._release: asyncio.Event | None = None
        self.pace = pace
        self.pace_timeout_s = pace_timeout_s
        self._paced: list[dict] = []  # each answer returned under pace: sample id, in flight, arrived so far, forced
        self._pace_order: list[object] = []  # the paced requests not answered yet, in arrival order
        self._pace_in_flight = 0
        self._pace_arrived = 0
        self._pace_condition: asyncio.Condition | None = None
        self.seed = seed
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # chat-completion requests per sample id
        self._tokenize_counts: Counter[str] = Counter()
        self._injected: Counter[str] = Counter()
        self._injected_ids: dict[str, set[str]] = {}  # fault kind -> the sample ids it hit
        self._authorization: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port: int | None = None

    # ------------------------------------------------------------ observations
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _copy(self, kind, observed):
        """A copy of what the handlers observed so far, taken under their lock: they keep adding while a test reads."""
        with self._lock:
            return kind(observed)

    def counts(self) -> Counter[str]:
        return self._copy(Counter, self._counts)

    def tokenize_counts(self) -> Counter[str]:
        return self._copy(Counter, self._tokenize_counts)

    def injected(self) -> Counter[str]:
        return self._copy(Counter, self._injected)

    def injected_ids(self, kind: str) -> set[str]:
        """The sample ids the fault ``kind`` hit: what a test derives the expected recovery from."""
        with self._lock:
            return set(self._injected_ids.get(kind, ()))

    def paced(self) -> list[dict]:
        """Under ``pace``: every answer returned, in order: ``id``, ``in_flight`` (sample requests in flight when it was
        returned, itself included), ``arrived`` (sample requests arrived by then) and ``forced`` (returned after
        ``pace_timeout_s`` below ``concurrency``)."""
        return self._copy(list, self._paced)

    def authorization_seen(self) -> set[str]:
        return self._copy(set, self._authorization)

    def release(self) -> None:
        """Let every held request, and every later one, through."""
        assert self._loop is not None and self._release is not None
        self._loop.call_soon_threadsafe(self._release.set)

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> FaultProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30) or self.port is None:
            raise RuntimeError("FaultProxy did not start")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        self._release = asyncio.Event()
        self._pace_condition = asyncio.Condition()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _shutdown(self) -> None:
        self._release.set()  # a held request ends with the proxy
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ----------------------------------------------------------------- handling
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        sample_id = urllib.parse.unquote(request.headers.get(SAMPLE_ID_HEADER, ""))
        if "authorization" in request.headers:
            with self._lock:
                self._authorization.add(request.headers["authorization"])
        if request.path == "/tokenize":
            with self._lock:
                self._tokenize_counts[sample_id] += 1
            if self.tokenize_delay_s:
                self._inject("tokenize_slow", None)
                await asyncio.sleep(self.tokenize_delay_s)
        if request.path != "/v1/chat/completions":
            return await self._forward(request, body)

        with self._lock:
            self._counts[sample_id] += 1
            nth = self._counts[sample_id]
            total = sum(self._counts.values())
            if sample_id != CANARY_ID:
                self._samples_seen += 1
            hold = self.hold_after is not None and sample_id != CANARY_ID and self._samples_seen > self.hold_after
        if hold and not self._release.is_set():
            self._inject("held", None, sample_id)
            await self._release.wait()
        if self.unavailable_after is not None and total > self.unavailable_after:
            return self._inject("unavailable", web.json_response({"error": {"message": "server gone (FaultProxy)"}}, status=503), sample_id)
        if sample_id in self.status_for_ids:
            status = self.status_for_ids[sample_id]
            return self._inject(f"status_{status}", web.json_response({"error": {"message": f"injected {status} (FaultProxy)", "code": status}}, status=status), sample_id)
        draw = random.Random(f"{self.seed}:{sample_id}:{nth}")
        if self.fault_kinds and draw.random() < self.fault_rate:
            kind = draw.choice(self.fault_kinds)
            if kind == "5xx":
                status = draw.choice((500, 502, 503))
                return self._inject("5xx", web.json_response({"error": {"message": f"injected {status} (FaultProxy)"}}, status=status), sample_id)
            if kind == "reset":
                self._inject("reset", None, sample_id)
                request.transport.abort()  # drop the connection without an answer
                raise ConnectionResetError("FaultProxy reset the connection")
            if kind == "slow":
                self._inject("slow", None, sample_id)
                await asyncio.sleep(self.slow_s)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if sample_id in self.malformed_ids:
            await self._forward(request, body)  # the server does the work; the answer is garbled on the way back
            return self._inject("malformed", web.Response(body=b'{"id": "chatcmpl-x", "choices": [{"message": {"reas', content_type="application/json"), sample_id)

        if self.pace is not None and sample_id != CANARY_ID:
            return await self._paced_answer(request, body, sample_id)

        spared = self.spare_canary and sample_id == CANARY_ID
        drop = not spared and (
            self.drop_reasoning or random.Random(f"{self.seed}:{sample_id}:drop").random() < self.drop_reasoning_share
        )
        rewrite = (self.rename_reasoning or drop) and not spared
        response = await self._forward(request, body, rewrite=rewrite, drop=drop)
        if drop:
            self._inject("reasoning_dropped", None, sample_id)
        return response

    async def _paced_answer(self, request: web.Request, body: bytes, sample_id: str) -> web.Response:
        """Forwards at once; answers in arrival order, each once ``concurrency`` are in flight (see the module)."""
        concurrency, samples = self.pace
        me = object()
        condition = self._pace_condition
        async with condition:
            self._pace_order.append(me)
            self._pace_in_flight += 1
            self._pace_arrived += 1
            condition.notify_all()
        response = await self._forward(request, body)
        async with condition:
            my_turn = lambda: self._pace_order[0] is me  # noqa: E731
            full = lambda: self._pace_in_flight >= concurrency or self._pace_arrived >= samples  # noqa: E731
            forced = False
            try:
                await asyncio.wait_for(condition.wait_for(lambda: my_turn() and full()), self.pace_timeout_s)
            except TimeoutError:
                forced = True
                await condition.wait_for(my_turn)
            with self._lock:
                self._paced.append({"id": sample_id, "in_flight": self._pace_in_flight, "arrived": self._pace_arrived, "forced": forced})
            self._pace_order.pop(0)
            self._pace_in_flight -= 1
            condition.notify_all()
        return response

    def _inject(self, kind: str, response, sample_id: str | None = None):
        with self._lock:
            self._injected[kind] += 1
            if sample_id is not None:
                self._injected_ids.setdefault(kind, set()).add(sample_id)
        return response

    async def _forward(self, request: web.Request, body: bytes, rewrite: bool = False, drop: bool = False) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body, headers=headers) as upstream:
            payload = await upstream.read()
            status, content_type = upstream.status, upstream.content_type
        if rewrite and status == 200:
            payload = self._rewrite(payload, drop)
        return web.Response(body=payload, status=status, content_type=content_type)

    def _rewrite(self, payload: bytes, drop: bool) -> bytes:
        data = json.loads(payload)
        for choice in data.get("choices", []):
            message = choice.get("message") or {}
            if drop:
                message.pop("reasoning", None)
                message.pop("reasoning_content", None)
            elif "reasoning" in message:
                message["reasoning_content"] = message.pop("reasoning")
        return json.dumps(data).encode()
