"""Drives an :class:`Engine` from a background thread and streams outputs to asyncio callers.

The HTTP server awaits ``generate``; the engine thread owns all engine state. Adds and aborts
cross threads through a command queue, outputs come back with ``call_soon_threadsafe``. A caller
that stops iterating (client disconnect, cancellation) aborts its request, which frees its
slot and pages before the next step.

With a ``profile_dir``, :meth:`AsyncEngine.start_profile` / :meth:`AsyncEngine.stop_profile` (vLLM's
names) record a ``jax.profiler`` trace there while the server runs (each engine step is one
annotated range in it: :data:`jaxdsa.engine.engine.STEP_MARK`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

import jax

from jaxdsa.engine.engine import Engine
from jaxdsa.engine.request import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are in flight than the server accepts; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine could not run this request (HTTP 503); the engine itself serves on."""


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_waiting: int = 256, profile_dir: str | None = None):
        self.engine = engine
        self.profile_dir = profile_dir
        self._profiling = False
        self.max_in_flight = engine.config.max_num_seqs + max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxdsa-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        """Whether the engine thread is running (started and not shut down)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- engine thread -----------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _apply(self, command) -> None:
        kind, *args = command
        if kind == "add":
            request_id, prompt, sampling, handoff = args
            try:
                self.engine.add_request(request_id, prompt, sampling, **handoff)
            except ValueError as e:
                self._deliver(request_id, e)
            except Exception as e:  # a bug, not bad input: still only this request fails
                log.exception("adding request %s failed", request_id)
                self._deliver(request_id, EngineDeadError(f"could not add the request: {e}"))
        elif kind == "abort":
            self.engine.abort(args[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._apply(self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            if self._stop.is_set():
                break
            try:
                outputs = self.engine.step()
            except Exception as e:  # the step isolates its own failures; this is the last resort
                log.exception("engine step failed outside its isolation; failing the requests in flight")
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                    self._deliver(request_id, EngineDeadError(str(e)))
                continue
            for out in outputs:
                failed = out.finish_reason is FinishReason.ERROR
                self._deliver(out.request_id, EngineDeadError(out.error) if failed else out)

    # -- profiling ---------------------------------------------------------------------------------
    def start_profile(self) -> None:
        """Start a ``jax.profiler`` trace into ``profile_dir`` (a perfetto trace beside XLA's files).
        RuntimeError without a profile_dir or while a trace runs."""
        if self.profile_dir is None:
            raise RuntimeError("profiling is off: the engine was started without a profile directory")
        with self._lock:
            if self._profiling:
                raise RuntimeError("a profile is already being recorded")
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # kernels and annotations; Python frames would swamp it
            jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True, profiler_options=options)
            self._profiling = True

    def stop_profile(self) -> None:
        """Stop the trace and write it. RuntimeError when none runs."""
        with self._lock:
            if not self._profiling:
                raise RuntimeError("no profile is being recorded")
            self._profiling = False
            jax.profiler.stop_trace()

    # -- caller side -------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, **handoff
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per generated token until the request finishes. ``handoff``:
        ``export`` / ``source`` for :meth:`Engine.add_request` (disaggregated serving).

        Raises ValueError (bad request), QueueFullError (overloaded) before the first output.
        """
        self.engine.check(prompt, sampling)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if len(self._streams) >= self.max_in_flight:
                raise QueueFullError(f"{len(self._streams)} requests in flight; try again later")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, q)
        self._commands.put(("add", request_id, list(prompt), sampling, handoff))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
