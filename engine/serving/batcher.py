"""Continuous batching: one scheduler thread owns the devices and keeps a batch of image slots per plan.

Every image of every request is a slot. A batch advances all its occupied slots by a chunk of steps
with one program; between chunks, finished images are decoded and handed back, new requests of the
same plan take the free slots at once (they never wait for another request's whole run), and a
stopped or failed request's slots are cleared. Plans (shapes) take turns chunk by chunk, and at most
`max_live_plans` batches exist at once; a request whose plan has no batch and cannot get one blocks
the queue behind it, so the batches ahead drain and no shape starves. Programs are compiled on threads
of their own (`Programs`); a request waits for its plan's compile without holding up anyone else's chunks.

Faults stay where they start: NaN or inf in a slot fails only that request; an exception in a batch's
program fails that batch's requests, and the next batch is served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import NamedSharding
from PIL import Image

from .. import schedulers
from ..errors import Busy, Cancelled, GenerationFailed
from ..request import GenerationResult
from ..sampling.pipeline import Admission, Plan
from ..sampling.preview import PreviewMap
from .programs import CompiledPlan, Programs, lane_widths
from .ticket import Failed, Finished, Preview, Progress, Queued, Ticket

log = logging.getLogger("jax-sd")


@dataclass
class Job:
    """A request inside the engine: its host-side inputs, one row per image, and where its images are."""

    ticket: Ticket
    plan: Plan
    ids: np.ndarray  # [chunks, 77] or [chunks, encoders, 77]
    weights: np.ndarray  # f32, the shape of ids: each token's emphasis
    neg_ids: np.ndarray
    neg_weights: np.ndarray
    extra: dict[str, np.ndarray]  # one image's row of each
    tables: schedulers.Tables  # host arrays, scalar leaves
    seeds: list[int]
    guidance_scale: float
    latents: np.ndarray | None  # [n, h, w, c] NHWC, or None: drawn from the seeds
    latent_shape: tuple[int, int, int]  # (h, w, c) of one image's latents
    control: np.ndarray | None = None  # [H, W, 3] in [0, 1]: the control image, with `plan.control`
    control_scale: float = 1.0  # controlnet_conditioning_scale
    lora_weights: tuple[float, ...] = ()  # one per loaded LoRA: the batch's merged params depend on them
    source: object = None  # modes.Source of one image (host arrays), or None for text-to-image
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    compile_s: float = 0.0
    compiled: bool = False
    compile_asked: bool = False
    waiting: deque = field(default_factory=deque)  # image indices not yet in a slot
    steps: dict[int, int] = field(default_factory=dict)  # image index -> loop steps done
    images: dict[int, tuple[np.ndarray, str]] = field(default_factory=dict)  # index -> (picture, device)
    position: int | None = None
    last_preview: float = 0.0

    def __post_init__(self):
        self.waiting.extend(range(len(self.seeds)))

    @property
    def loop_steps(self) -> int:
        return int(self.tables.num_loop_steps)

    @property
    def failed(self) -> bool:
        return self.ticket.done

    @property
    def key(self) -> tuple:
        """What a batch's slots share: the plan (its programs) and the LoRA weights (its merged params)."""
        return (self.plan, self.lora_weights)


@dataclass
class Batch:
    """One plan's running batch: device slots and, on the host, who sits in each and how far it is."""

    programs: CompiledPlan
    slots: object  # pipeline.Slots on the devices
    occupant: list[tuple[Job, int] | None]  # slot -> (job, image index)
    step: list[int]  # slot -> loop steps done (mirrors the device)
    changes: dict[int, tuple[Job, int] | None] = field(default_factory=dict)  # slot -> new occupant (None: clear)
    params: object = None  # the params its programs run with (LoRAs merged at the batch's weights)
    key: tuple = ()  # Job.key of every job in it

    def free(self) -> list[int]:
        """Free slots, lowest lane first on every device: requests pack into the narrowest programs."""
        free = [k for k, o in enumerate(self.occupant) if o is None and k not in self.changes]
        per = self.programs.plan.slots_per_device
        return sorted(free, key=lambda k: (k % per, k // per))

    def busy(self) -> bool:
        return any(o is not None for o in self.occupant) or any(c is not None for c in self.changes.values())


class Batcher:
    """Owns the devices; `submit` hands it a Job, its thread does the rest."""

    def __init__(
        self,
        programs: Programs,
        params,
        blank: Callable[[Plan], Job],
        devices: list[str],
        lanes: NamedSharding,
        preview: Callable[[], PreviewMap | None] | None = None,
        chunk_steps: int = 1,
        max_waiting: int = 256,
        max_live_plans: int = 2,
        preview_every_s: float = 0.3,
        params_for: Callable[[tuple[float, ...]], object] | None = None,
    ):
        """`params_for(lora_weights)`: the params a batch with those LoRA weights runs with (default: `params`).
        `preview()`: the map that draws live previews, None until it is ready (it is fitted in the background)."""
        self.programs, self.params, self.devices = programs, params, devices
        self._params_for = params_for or (lambda weights: params)
        self._blank = blank  # plan -> the job whose row an empty slot holds: no steps to run
        self._lanes = lanes  # the slot axis over the devices
        self.preview = preview
        self.chunk_steps, self.max_waiting, self.max_live_plans = chunk_steps, max_waiting, max_live_plans
        self.preview_every_s = preview_every_s
        self._inbox: deque[Job] = deque()
        self._waiting: list[Job] = []  # scheduler thread only, oldest first
        self._batches: dict[tuple, Batch] = {}  # Job.key -> its batch
        self._turn = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stop = False
        self.chunks_run = 0  # counters for tests and benchmarks
        self._thread = threading.Thread(target=self._loop, name="jax-sd-batcher", daemon=True)
        self._thread.start()

    # -- called from any thread ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if len(self._inbox) + len(self._waiting) >= self.max_waiting:
                raise Busy(f"the server is busy ({self.max_waiting} requests waiting); try again in a moment")
            self._inbox.append(job)
        job.ticket._on_cancel = self._wake.set
        self._wake.set()

    def close(self) -> None:
        self._stop = True
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
                if batch is None:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._run_chunk(batch)
            except Exception:  # the loop itself must never die: log, fail nothing silently, go on
                log.exception("batcher loop error")
                time.sleep(0.1)

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    def _fail(self, job: Job, error: BaseException) -> None:
        """Ends `job` with `error` and clears every slot it holds."""
        job.ticket.emit(Failed(error))
        for batch in self._batches.values():
            for k, occupant in enumerate(batch.occupant):
                if occupant is not None and occupant[0] is job:
                    batch.occupant[k] = None
                    batch.changes[k] = None
            for k, change in list(batch.changes.items()):
                if change is not None and change[0] is job:
                    batch.changes[k] = None
        if job in self._waiting:
            self._waiting.remove(job)

    def _drop_cancelled(self) -> None:
        for job in self._jobs():
            if job.ticket.cancel_requested and not job.failed:
                self._fail(job, Cancelled("stopped before it finished"))

    def _jobs(self) -> list[Job]:
        jobs = {id(j): j for j in self._waiting}
        for batch in self._batches.values():
            for entry in [*batch.occupant, *batch.changes.values()]:
                if entry is not None:
                    jobs[id(entry[0])] = entry[0]
        return list(jobs.values())

    def _place(self) -> None:
        """Gives free slots to waiting requests, oldest first (see the module docstring for fairness)."""
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
                if job.started is None:
                    job.started = time.perf_counter()
            if not job.waiting:
                self._waiting.remove(job)
        position = 0
        for job in self._waiting:
            if job.started is None:
                position += 1
                if job.position != position:
                    job.position = position
                    job.ticket.emit(Queued(position))

    def _ideal(self, plan: Plan, needed: int) -> int:
        return min(w for w in lane_widths(plan.slots_per_device) if w >= needed)

    def _compile_for(self, job: Job) -> None:
        """Asks for the plan's programs, as wide as the job needs, in the background; everyone else goes on."""
        width = self._ideal(job.plan, min(-(-len(job.seeds) // job.plan.devices), job.plan.slots_per_device))
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

    def _needed(self, batch: Batch) -> int:
        """Lanes per device that the batch's next chunk touches (new and occupied slots)."""
        slots = [k for k, o in enumerate(batch.occupant) if o is not None] + list(batch.changes)
        return max(k % batch.programs.plan.slots_per_device for k in slots) + 1

    def _next_batch(self) -> Batch | None:
        """Round robin over the batches with work whose programs are compiled: each plan gets a chunk in turn."""
        for key in [k for k, b in self._batches.items() if not b.busy()]:
            del self._batches[key]  # drained: free its device memory and its place among the live plans
        runnable = []
        for key, batch in self._batches.items():
            if not batch.busy():
                continue
            plan = batch.programs.plan
            needed = self._needed(batch)
            ideal = self._ideal(plan, needed)
            if ideal not in batch.programs.lanes:  # wider programs serve meanwhile, if there are any
                new = [change[0] for change in batch.changes.values() if change is not None]
                self._ask(plan, ideal, new)
            if batch.programs.fit(needed) is not None:
                runnable.append(key)
        if not runnable:
            return None
        self._turn = (self._turn + 1) % len(runnable)
        return self._batches[runnable[self._turn]]

    def _admission(self, batch: Batch) -> Admission:
        rows = []
        for k in range(len(batch.occupant)):
            change = batch.changes.get(k, False)
            rows.append(self._row(*change) if change else self._row(self._blank(batch.programs.plan), 0))
        mask = np.array([k in batch.changes for k in range(len(batch.occupant))])
        stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *rows)
        return Admission(mask=mask, **stacked)

    @staticmethod
    def _row(job: Job, index: int) -> dict:
        given = job.latents is not None
        latents = job.latents[index] if given else np.zeros(job.latent_shape, np.float32)
        control = {}
        if job.plan.control:
            control = dict(control=job.control, control_scale=np.float32(job.control_scale))
        return dict(
            **control,
            ids=job.ids,
            weights=job.weights,
            neg_ids=job.neg_ids,
            neg_weights=job.neg_weights,
            extra=job.extra,
            latents=latents,
            given=np.bool_(given),
            seeds=np.uint32(job.seeds[index]),
            guidance_scale=np.float32(job.guidance_scale),
            tables=job.tables,
            source=job.source,
        )

    @staticmethod
    def _width(batch: Batch, slots: list[int]) -> int:
        """The narrowest compiled width that covers `slots` (`_next_batch` made sure there is one)."""
        return batch.programs.fit(max(k % batch.programs.plan.slots_per_device for k in slots) + 1)

    def _run_chunk(self, batch: Batch) -> None:
        plan = batch.programs.plan
        try:
            if batch.changes:
                admission = jax.device_put(self._admission(batch), self._lanes)
                program = batch.programs.lanes[self._width(batch, list(batch.changes))].admit
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
            program = batch.programs.lanes[self._width(batch, occupied)].advance
            batch.slots, finite = program(batch.params, batch.slots, np.int32(n))
            finite = np.asarray(finite)
            self.chunks_run += 1
        except Exception as error:  # this batch's requests fail; the next batch is served
            log.exception("a batch of %s failed", plan)
            message = GenerationFailed(f"the batch running this request failed: {type(error).__name__}: {error}")
            for job in self._jobs_in(batch):
                self._fail(job, message)
            self._batches.pop(batch.key, None)
            return
        for k in occupied:
            batch.step[k] += n
        self._after_chunk(batch, occupied, finite)

    def _jobs_in(self, batch: Batch) -> list[Job]:
        seen = {}
        for entry in [*batch.occupant, *batch.changes.values()]:
            if entry is not None:
                seen[id(entry[0])] = entry[0]
        return list(seen.values())

    def _after_chunk(self, batch: Batch, occupied: list[int], finite: np.ndarray) -> None:
        for k in occupied:
            job, index = batch.occupant[k]
            if job.failed:
                continue
            if not finite[k]:
                self._fail(
                    job,
                    GenerationFailed(
                        f"image {index + 1} (seed {job.seeds[index]}) diverged: NaN or inf in its latents at step "
                        f"{batch.step[k]}; try another seed, fewer steps or a lower guidance scale"
                    ),
                )
                continue
            job.steps[index] = batch.step[k]
        finished = [
            k for k in occupied if batch.occupant[k] is not None and batch.step[k] >= batch.occupant[k][0].loop_steps
        ]
        jobs = self._jobs_in(batch)
        for job in jobs:
            n = len(job.seeds)
            job.ticket.emit(Progress(min(sum(job.steps.values()) // n, job.loop_steps), job.loop_steps))
        preview = self.preview() if self.preview is not None else None
        if preview is not None and not finished:
            self._previews(batch, jobs, preview)
        if finished:
            self._decode(batch, finished)

    def _previews(self, batch: Batch, jobs: list[Job], preview: PreviewMap) -> None:
        now = time.perf_counter()
        due = [j for j in jobs if now - j.last_preview >= self.preview_every_s]
        if not due:
            return
        latents = np.asarray(batch.slots.x)
        for job in due:
            job.last_preview = now
            slots = [k for k, o in enumerate(batch.occupant) if o is not None and o[0] is job]
            job.ticket.emit(Preview([preview(latents[k]) for k in slots]))

    def _decode(self, batch: Batch, finished: list[int]) -> None:
        width = self._width(batch, finished)
        try:
            pictures, flagged = batch.programs.lanes[width].decode(batch.params, batch.slots.x)
            pictures, flagged = np.asarray(pictures), np.asarray(flagged)
        except Exception as error:
            log.exception("decoding failed")
            for job in {id(batch.occupant[k][0]): batch.occupant[k][0] for k in finished}.values():
                self._fail(job, GenerationFailed(f"decoding failed: {type(error).__name__}: {error}"))
            return
        per = batch.programs.plan.slots_per_device
        for k in finished:
            job, index = batch.occupant[k]
            batch.occupant[k] = None
            if job.failed:
                continue
            device, lane = divmod(k, per)
            row = device * width + lane
            # A flagged picture never leaves the engine: black in its place, as diffusers does.
            picture = np.zeros_like(pictures[row]) if flagged[row] else pictures[row]
            job.images[index] = (picture, self.devices[device], bool(flagged[row]))
            if len(job.images) == len(job.seeds):
                job.ticket.emit(Finished(self._result(job)))

    def _result(self, job: Job) -> GenerationResult:
        order = sorted(job.images)
        arrays = np.stack([job.images[i][0] for i in order])
        now = time.perf_counter()
        started = job.started or now
        return GenerationResult(
            images=[Image.fromarray(np.round(a * 255).astype(np.uint8)) for a in arrays],
            seeds=list(job.seeds),
            devices=[job.images[i][1] for i in order],
            nsfw_content_detected=[job.images[i][2] for i in order],
            timings={
                "queue_s": started - job.submitted,
                "compile_s": job.compile_s,
                "run_s": now - started,
                "total_s": now - job.submitted,
            },
            compiled=job.compiled,
            warnings=list(job.ticket.warnings),
            arrays=arrays,
            request=job.ticket.request,
        )
