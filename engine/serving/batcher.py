"""Continuous batching: one scheduler thread owns the devices and keeps a batch of image slots per plan.

Every image of every request is a slot. A batch advances all its occupied slots by a chunk of steps
with one program; between chunks, finished images are decoded and handed back, new requests of the
same plan take the free slots at once (they never wait for another request's whole run), and a
stopped or failed request's slots are cleared. Waiting requests take slots in their callers' turns
(`in_turns`): a newcomer's first request goes ahead of a flooder's next one, not behind all of them.
Plans (shapes) take turns chunk by chunk, and at most `max_live_plans` batches exist at once; a request
whose plan has no batch and cannot get one blocks the queue behind it, so the batches ahead drain and no
shape starves. Programs are compiled on threads of their own (`Programs`); a request waits for its plan's
compile without holding up anyone else's chunks.

Faults stay where they start: NaN or inf in a slot fails only that request; an exception in a batch's
program fails that batch's requests, and the next batch is served.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..errors import Busy, Cancelled, GenerationFailed
from ..sampling.pipeline import Plan
from ..sampling.preview import Previewer
from .programs import Programs, ideal_width
from .slots import Batch, Job, emit_previews, hand_back, record_steps, run_decode, width_for
from .slots import admission as make_admission
from .ticket import Failed, Progress, Queued

log = logging.getLogger("jax-sd")


def in_turns(waiting: list[Job], served: dict[str, int]) -> list[Job]:
    """The waiting line in callers' turns. A caller's k-th request in line ranks k-th, and among those of one rank
    the caller who got a slot longest ago (`served`: caller -> when; never: first) goes first, then the older.
    One caller's requests keep their order; a newcomer's first request goes ahead of a flooder's next one."""
    count: Counter[str] = Counter()
    ranked = []
    for job in sorted(waiting, key=lambda job: job.submitted):
        caller = job.ticket.caller
        ranked.append((count[caller], served.get(caller, -1), job.submitted, job))
        count[caller] += 1
    return [entry[-1] for entry in sorted(ranked, key=lambda entry: entry[:3])]


def report_positions(waiting: list[Job]) -> None:
    """Tells each request still waiting for its first slot its place in the line, when it changes."""
    unstarted = [job for job in waiting if job.started is None]
    for position, job in enumerate(unstarted, 1):
        if job.position != position:
            job.position = position
            job.ticket.emit(Queued(position))


class Idleness:
    """When a request last waited or drew, and whether a chunk is being drawn: what work nobody waits for (the
    warm-up's plans after Ready) waits on, so that it does not halve the cores under a request that is drawing."""

    def __init__(self):
        self.last_busy, self.drawing, self.closed = -float("inf"), False, False

    def busy(self, drawing: bool | None = None) -> None:
        """A request waits or draws now; `drawing`: whether a chunk is being drawn from now on."""
        self.last_busy = time.monotonic()
        if drawing is not None:
            self.drawing = drawing

    @contextlib.contextmanager
    def drawing_chunk(self):
        """Drawing while in scope, however the chunk ends (a chunk that raises leaves the engine idle, not drawing)."""
        self.busy(drawing=True)
        try:
            yield
        finally:
            self.busy(drawing=False)

    def wait(self, quiet: float) -> bool:
        """Blocks until no request has waited or drawn for `quiet` seconds: True then, False once closed."""
        while not self.closed:
            left = quiet if self.drawing else self.last_busy + quiet - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.25))
        return False


class Batcher:
    """Owns the devices; `submit` hands it a Job, its thread does the rest."""

    def __init__(
        self,
        programs: Programs,
        params,
        blank: Callable[[Plan], Job],
        devices: list[str],
        lanes: NamedSharding,
        preview: Callable[[], Previewer | None] | None = None,
        chunk_steps: int = 1,
        max_waiting: int = 256,
        max_live_plans: int = 2,
        preview_every_s: float = 0.3,
        params_for: Callable[[tuple[float, ...]], object] | None = None,
    ):
        """`params_for(lora_weights)`: the params a batch with those LoRA weights runs with (default: `params`).
        `preview()`: what draws live previews, None until it is ready: a latent-to-RGB map (fitted in the
        background), or `DecodedPreview`, the batch's decode program over the slots' current latents."""
        self.programs, self.params, self.devices = programs, params, devices
        self._params_for = params_for or (lambda weights: params)
        self._blank = blank  # plan -> the job whose row an empty slot holds: no steps to run
        self._lanes = lanes  # the slot axis over the devices
        self.preview, self.preview_every_s = preview, preview_every_s
        self.chunk_steps, self.max_waiting, self.max_live_plans = chunk_steps, max_waiting, max_live_plans
        self._inbox: deque[Job] = deque()
        self._waiting: list[Job] = []  # scheduler thread only, in callers' turns (`in_turns`)
        self._batches: dict[tuple, Batch] = {}  # Job.key -> its batch
        self._served: dict[str, int] = {}  # caller -> the admission count when it last got a slot (`in_turns`)
        self._turn, self._admissions = 0, 0
        self._wake, self._lock = threading.Event(), threading.Lock()
        self._stop, self.idle = False, Idleness()  # `idle`: what the warm-up's later plans wait for
        self.chunks_run = 0  # counters for tests and benchmarks
        self._thread = threading.Thread(target=self._loop, name="jax-sd-batcher", daemon=True)
        self._thread.start()

    # -- called from any thread ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stop:  # a closed engine's requests would wait forever
                raise Busy("this model's engine has shut down (the server is switching models or stopping); try again")
            if len(self._inbox) + len(self._waiting) >= self.max_waiting:
                raise Busy(f"the server is busy ({self.max_waiting} requests waiting); try again in a moment")
            self._inbox.append(job)
            self.idle.busy()
        job.ticket._on_cancel = self._wake.set
        self._wake.set()

    def close(self) -> None:
        with self._lock:  # no request is taken after this (`submit`); the thread ends those it holds (`_loop`)
            self._stop = True
        self.idle.closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def live_plans(self) -> list[Plan]:
        return [key[0] for key in self._batches]

    # -- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            try:
                self._take_inbox()
                self._drop_cancelled()
                self._place()
                batch = self._next_batch()
                if self._waiting:
                    self.idle.busy()
                if batch is None:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                with self.idle.drawing_chunk():
                    self._run_chunk(batch)
            except Exception:  # the loop itself must never die: log, fail nothing silently, go on
                log.exception("batcher loop error")
                time.sleep(0.1)
        self._take_inbox()  # closed: the requests still held end, saying why, rather than wait forever
        for job in self._jobs():
            self._fail(job, GenerationFailed("the server closed this model's engine before the request finished"))

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    def _fail(self, job: Job, error: BaseException) -> None:
        """Ends `job` with `error` and clears every slot it holds."""
        job.ticket.emit(Failed(error))
        for batch in self._batches.values():
            batch.clear(job)
        if job in self._waiting:
            self._waiting.remove(job)

    def _drop_cancelled(self) -> None:
        for job in self._jobs():
            if job.ticket.cancel_requested and not job.failed:
                self._fail(job, Cancelled("stopped before it finished"))

    def _jobs(self) -> list[Job]:
        jobs = {id(j): j for j in self._waiting}
        jobs.update((id(j), j) for batch in self._batches.values() for j in batch.jobs())
        return list(jobs.values())

    def _place(self) -> None:
        """Gives free slots to waiting requests in callers' turns (see the module docstring for fairness)."""
        present = {job.ticket.caller for job in self._jobs()}
        self._served = {caller: when for caller, when in self._served.items() if caller in present}  # bounded
        self._waiting = in_turns(self._waiting, self._served)
        for job in list(self._waiting):
            if job.failed:
                self._waiting.remove(job)
                continue
            batch = self._batches.get(job.key)
            if batch is None:
                programs = self.programs.get(job.plan)
                if programs is None:
                    self._compile_for(job)
                    continue
                if len(self._batches) >= self.max_live_plans:
                    break  # wait for a running batch to drain; nobody behind this request jumps ahead
                empty = [None] * job.plan.batch
                try:
                    params = self._params_for(job.lora_weights)
                except Exception as error:  # this request fails; the others go on
                    log.exception("merging LoRAs at %s failed", job.lora_weights)
                    self._fail(job, GenerationFailed(f"merging the LoRAs failed: {type(error).__name__}: {error}"))
                    continue
                batch = Batch(programs, programs.empty(), empty, [0] * job.plan.batch, params=params, key=job.key)
                self._batches[job.key] = batch
            for k in batch.free():
                if not job.waiting:
                    break
                batch.changes[k] = (job, job.waiting.popleft())
                self._served[job.ticket.caller] = self._admissions
                self._admissions += 1
                if job.started is None:
                    job.started = time.perf_counter()
            if not job.waiting:
                self._waiting.remove(job)
        report_positions(self._waiting)

    def _compile_for(self, job: Job) -> None:
        """Asks for the plan's programs, as wide as the job needs, in the background; everyone else goes on."""
        width = ideal_width(job.plan, min(-(-len(job.seeds) // job.plan.devices), job.plan.slots_per_device))
        self._ask(job.plan, width, [job])

    def _ask(self, plan: Plan, width: int, jobs: list[Job]) -> None:
        """Requests `plan` at `width`; the jobs that wait for it learn how long it took and whether it compiled."""
        if self.programs.pending(plan):
            jobs = []  # someone else's compile (the warm-up's, say): not these jobs' doing
        jobs = [j for j in jobs if not j.compile_asked]
        for job in jobs:
            job.compile_asked = True
        started = time.perf_counter()

        def done(future) -> None:
            error = future.exception()
            for job in jobs:
                if error is None:
                    job.compile_s += time.perf_counter() - started
                    job.compiled = job.compiled or future.result().lanes[width].fresh
                else:
                    message = f"compiling for this size failed: {type(error).__name__}: {error}"
                    job.ticket.emit(Failed(GenerationFailed(message)))
            if error is not None:
                log.error("compiling %s at width %d failed: %s", plan, width, error)
            self._wake.set()

        self.programs.request(plan, width, on_done=done)

    def _next_batch(self) -> Batch | None:
        """Round robin over the batches with work whose programs are compiled: each plan gets a chunk in turn."""
        for key in [k for k, b in self._batches.items() if not b.busy()]:
            del self._batches[key]  # drained: free its device memory and its place among the live plans
        runnable = []
        for key, batch in self._batches.items():
            if not batch.busy():
                continue
            plan = batch.programs.plan
            needed = batch.needed()
            ideal = ideal_width(plan, needed)
            if ideal not in batch.programs.lanes:  # wider programs serve meanwhile, if there are any
                new = [change[0] for change in batch.changes.values() if change is not None]
                self._ask(plan, ideal, new)
            if batch.programs.fit(needed) is not None:
                runnable.append(key)
        if not runnable:
            return None
        self._turn = (self._turn + 1) % len(runnable)
        return self._batches[runnable[self._turn]]

    def _run_chunk(self, batch: Batch) -> None:
        plan = batch.programs.plan
        try:
            if batch.changes:
                admission = jax.device_put(make_admission(batch, self._blank(batch.programs.plan)), self._lanes)
                program = batch.programs.lanes[width_for(batch, list(batch.changes))].admit
                batch.slots = program(batch.params, batch.slots, admission)
                for k, change in batch.changes.items():
                    batch.occupant[k] = change
                    batch.step[k] = 0
                batch.changes.clear()
            occupied = [k for k, o in enumerate(batch.occupant) if o is not None]
            if not occupied:
                return
            left = [batch.occupant[k][0].loop_steps - batch.step[k] for k in occupied]
            n = max(1, min(self.chunk_steps, min(left)))  # end the chunk when the first slot finishes
            program = batch.programs.lanes[width_for(batch, occupied)].advance
            batch.slots, finite = program(batch.params, batch.slots, np.int32(n))
            finite = np.asarray(finite)
            self.chunks_run += 1
        except Exception as error:  # this batch's requests fail; the next batch is served
            log.exception("a batch of %s failed", plan)
            message = GenerationFailed(f"the batch running this request failed: {type(error).__name__}: {error}")
            for job in batch.jobs():
                self._fail(job, message)
            self._batches.pop(batch.key, None)
            return
        for k in occupied:
            batch.step[k] += n
        self._after_chunk(batch, occupied, finite)

    def _after_chunk(self, batch: Batch, occupied: list[int], finite: np.ndarray) -> None:
        for job, message in record_steps(batch, occupied, finite):
            self._fail(job, GenerationFailed(message))
        finished = [
            k for k in occupied if batch.occupant[k] is not None and batch.step[k] >= batch.occupant[k][0].loop_steps
        ]
        jobs = batch.jobs()
        for job in jobs:
            n = len(job.seeds)
            job.ticket.emit(Progress(min(sum(job.steps.values()) // n, job.loop_steps), job.loop_steps))
        preview = self.preview() if self.preview is not None else None
        if preview is not None and not finished:
            emit_previews(batch, jobs, preview, self.preview_every_s)
        if finished:
            self._decode(batch, finished)

    def _decode(self, batch: Batch, finished: list[int]) -> None:
        try:
            pictures, flagged, width = run_decode(batch, finished)
        except Exception as error:
            log.exception("decoding failed")
            for job in {id(batch.occupant[k][0]): batch.occupant[k][0] for k in finished}.values():
                self._fail(job, GenerationFailed(f"decoding failed: {type(error).__name__}: {error}"))
            return
        hand_back(batch, finished, pictures, flagged, width, self.devices)
