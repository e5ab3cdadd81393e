"""The asyncio face of the engine for the server: `generate()` streams a request group's outputs.

One background task drives `engine.step()` while any stream waits, and sleeps on an event when none
does. Every engine call (add_request, abort, step) runs on one worker thread, so the engine is never
used concurrently and the event loop never blocks on the model. A consumer that stops iterating
(break, exception, cancellation = client disconnect) aborts its group, freeing its cache.

A KV pull (`import_blocks`) is the one piece of engine work beside the steps: its blocks are held on the worker
(LLMEngine.begin_import), the executor reads and writes them on this engine's pull thread while steps go on (no
step reads, reuses or hits a held, unpublished block), and they are published on the worker (end_import).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar

from engine.core.cache_manager import PendingImport
from engine.core.engine import LLMEngine, RequestError, RequestOutput
from engine.core.kv_import import BlockReader
from engine.core.sampling_params import SamplingParams
from engine.vision.inputs import ImageInput

T = TypeVar("T")


class EngineStuckError(RuntimeError):
    """Requests wait but the scheduler can place none of them (e.g. a cache too small for a prompt)."""


class EngineShutdownError(RuntimeError):
    """The AsyncEngine was shut down while the request was streaming (or before it was added)."""


_GROUP_DONE = None  # queue sentinel: every choice of the group finished


@dataclass(slots=True)
class _Stream:
    num_choices: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException | _GROUP_DONE
    num_finished: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._puller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-pull")
        self._pull_lock: asyncio.Lock | None = None
        self._num_pulls = 0  # pulls holding blocks now
        self._num_pulls_ended = 0
        self._streams: dict[str, _Stream] = {}  # group id -> its consumer's stream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._is_shut_down = False

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                       force_ids: list[int] | None = None, images: Sequence[ImageInput] = ()
                       ) -> AsyncIterator[RequestOutput]:
        """Every RequestOutput of the group (request_id and its n-1 siblings) as steps produce them;
        returns when all n choices finished. RequestError propagates before anything is yielded."""
        if self._is_shut_down:
            raise EngineShutdownError("the engine is shut down")
        self._start()
        if request_id in self._streams:  # the engine would refuse it too, but after we replaced the stream
            raise RequestError(f"request id {request_id!r} is already in use")
        stream = _Stream(params.n)
        # the add is queued on the worker before the driver can queue a step for this stream
        added = self._on_worker(self.engine.add_request, request_id, prompt_ids, params, force_ids, False, images)
        self._streams[request_id] = stream
        try:
            await added
        except RequestError:
            self._streams.pop(request_id, None)
            raise
        except BaseException:  # cancelled while adding: the add may still land on the worker
            self._streams.pop(request_id, None)
            await self._abort(request_id)
            raise
        self._wake.set()
        is_done = False
        try:
            while True:
                items = [await stream.queue.get()]
                while not stream.queue.empty():  # a consumer that fell behind gets fewer, larger outputs
                    items.append(stream.queue.get_nowait())
                for item in coalesce(items):
                    if item is _GROUP_DONE:
                        is_done = True
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            if not is_done:
                self._streams.pop(request_id, None)
                await self._abort(request_id)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the engine's worker thread, between two steps (e.g. export KV blocks: the engine is
        never touched concurrently with a step)."""
        if self._is_shut_down:
            raise EngineShutdownError("the engine is shut down")
        self._start()
        return await self._on_worker(fn, *args)

    async def import_blocks(self, fingerprint: bytes, hashes: list[bytes], reader: BlockReader) -> int:
        """A KV pull beside the steps: LLMEngine.begin_import on the worker (blocks held, unpublished), the
        executor's import_blocks on the pull thread while steps go on, LLMEngine.end_import on the worker (the
        blocks published, or freed if the read raised). Returns the tokens of hashes' leading run held here
        then; raises what the read raised, or PrefixImportError. One pull at a time: a second pull waits for
        the one in flight to end, then finds the blocks it published held here and reads only the others (the
        executor's one staging buffer would take the reads in turn anyway). The pull ends and releases its
        blocks even if its caller is cancelled meanwhile."""
        if self._is_shut_down:
            raise EngineShutdownError("the engine is shut down")
        self._start()
        return await asyncio.shield(self._pull(fingerprint, hashes, reader))

    async def shutdown(self) -> None:
        """Stop stepping, abort every request, fail the waiting streams, release the worker thread."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
        if self._loop is not None:
            await self._on_worker(self._abort_all)  # queued behind a step still running on the worker
        error = EngineShutdownError("the engine shut down while the request was running")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
        self._worker.shutdown(wait=True)
        self._puller.shutdown(wait=True)

    # ---- internals ----------------------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._wake, self._pull_lock = loop, asyncio.Event(), asyncio.Lock()
            self._driver = loop.create_task(self._drive(), name="engine-driver")
        elif self._loop is not loop:
            raise RuntimeError("an AsyncEngine serves the event loop it first ran on; make one per loop")

    async def _abort(self, request_id: str) -> None:
        if not self._is_shut_down:  # shutdown aborts everything itself
            # shielded: a second cancellation must not leave the group holding its cache
            await asyncio.shield(self._on_worker(self.engine.abort, request_id))

    def _on_worker(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        return self._loop.run_in_executor(self._worker, fn, *args)

    async def _pull(self, fingerprint: bytes, hashes: list[bytes], reader: BlockReader) -> int:
        async with self._pull_lock:
            pending = await self._on_worker(self.engine.begin_import, fingerprint, hashes)
            self._num_pulls += 1
            write: Future | None = None
            try:
                if pending.fresh:
                    write = self._puller.submit(self.engine.executor.import_blocks, pending.fresh_blocks,
                                                reader.select(pending.fresh))
                    await asyncio.wrap_future(write)
            finally:
                try:
                    num_held = await self._on_worker(self._end_pull, pending, write)
                finally:
                    self._num_pulls -= 1
                    self._num_pulls_ended += 1
                    self._wake.set()  # the blocks it held are free: a request waiting for room may fit now
            return num_held

    def _end_pull(self, pending: PendingImport, write: Future | None) -> int:
        """On the worker: publish the pull's blocks if its write ended without error (or it had none to write),
        else free them. Waits for a write still running (only after a cancellation): its blocks must not be
        reused under it."""
        if write is None:
            return self.engine.end_import(pending, is_written=not pending.fresh)
        is_written = not write.cancelled() and write.exception() is None
        return self.engine.end_import(pending, is_written)

    async def _drive(self) -> None:
        """Step while streams wait; deliver each output to its group's stream; sleep when none waits."""
        num_idle = 0  # consecutive steps that scheduled nothing
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._streams:
                try:
                    progress = (self.engine.stats.num_steps, self._num_pulls_ended)
                    outputs = await self._on_worker(self.engine.step)
                except Exception as e:  # noqa: BLE001 -- handed to every consumer, which raises it
                    self._fail_all(e)
                    break
                # a pull that ended during the step may have freed blocks after the step looked for room
                num_idle = 0 if (self.engine.stats.num_steps, self._num_pulls_ended) != progress else num_idle + 1
                for out in outputs:
                    self._deliver(out)
                # one empty step is normal (everything was just preempted); two in a row mean no
                # request fits, and nothing changes until a request is added or aborted, or a pull that holds
                # blocks ends (it wakes this loop: wait for that)
                if num_idle >= 2 and self._streams and self._num_pulls:
                    num_idle = 0
                    break
                if num_idle >= 2 and self._streams:
                    self._fail_all(EngineStuckError("no waiting request can be scheduled: the cache is too small "
                                                    "for its next chunk"))
                    break

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.group_id)
        if stream is None:
            return  # the consumer has gone; its abort is queued on the worker
        stream.queue.put_nowait(out)
        if out.finished:
            stream.num_finished += 1
            if stream.num_finished == stream.num_choices:
                del self._streams[out.group_id]
                stream.queue.put_nowait(_GROUP_DONE)

    def _fail_all(self, error: BaseException) -> None:
        """The error ends every waiting stream (each consumer raises it and aborts its group)."""
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)


def coalesce(items: list) -> list:
    """Merge consecutive outputs of the same choice (tokens and logprobs concatenated, the later one's
    state), so a slow consumer's messages carry several tokens; markers and errors stay in place."""
    out: list = []
    for item in items:
        prev = out[-1] if out else None
        if (isinstance(item, RequestOutput) and isinstance(prev, RequestOutput) and prev.request_id == item.request_id
                and not prev.finished and prev.logits is None and item.logits is None):
            out[-1] = replace(item, new_token_ids=prev.new_token_ids + item.new_token_ids,
                              new_logprobs=prev.new_logprobs + item.new_logprobs)
        else:
            out.append(item)
    return out
