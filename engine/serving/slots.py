"""A batch's slots on the host: the jobs in them (`Job`), who sits where (`Batch`), the rows `admit` takes, where
a slot's picture is in a decode program's output, and a finished job's result. The batcher thread owns all of it."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import jax
import numpy as np
from PIL import Image

from .. import schedulers
from ..request import GenerationResult
from ..sampling.pipeline import Admission, Plan
from ..sampling.preview import DecodedPreview, Previewer
from .programs import CompiledPlan
from .ticket import Finished, Preview, Ticket

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
    references: tuple[np.ndarray, ...] = ()  # [H_i, W_i, 3] in [-1, 1]: the reference pictures, with `plan.references`
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    compile_s: float = 0.0
    compiled: bool = False
    compile_asked: bool = False
    waiting: deque = field(default_factory=deque)  # image indices not yet in a slot
    steps: dict[int, int] = field(default_factory=dict)  # image index -> loop steps done
    images: dict[int, tuple[np.ndarray, str]] = field(default_factory=dict)  # index -> (picture, device)
    latents_out: dict[int, np.ndarray] = field(default_factory=dict)  # index -> final latents [h, w, c], if asked
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

    def clear(self, job: Job) -> None:
        """Empties every slot `job` holds or was about to get."""
        for k, occupant in enumerate(self.occupant):
            if occupant is not None and occupant[0] is job:
                self.occupant[k] = None
                self.changes[k] = None
        for k, change in list(self.changes.items()):
            if change is not None and change[0] is job:
                self.changes[k] = None

    def jobs(self) -> list[Job]:
        """The jobs with a slot here, or about to get one."""
        seen = {}
        for entry in [*self.occupant, *self.changes.values()]:
            if entry is not None:
                seen[id(entry[0])] = entry[0]
        return list(seen.values())

    def needed(self) -> int:
        """Lanes per device that the batch's next chunk touches (new and occupied slots)."""
        slots = [k for k, o in enumerate(self.occupant) if o is not None] + list(self.changes)
        return max(k % self.programs.plan.slots_per_device for k in slots) + 1

    def busy(self) -> bool:
        return any(o is not None for o in self.occupant) or any(c is not None for c in self.changes.values())


def width_for(batch: Batch, slots: list[int]) -> int:
    """The narrowest compiled width that covers `slots` (`_next_batch` made sure there is one)."""
    return batch.programs.fit(max(k % batch.programs.plan.slots_per_device for k in slots) + 1)


def run_decode(batch: Batch, slots: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """The batch's decode program over its latents, at the narrowest compiled width that covers `slots`:
    pictures [devices * width, H, W, 3] in [0, 1], safety flags, and the width."""
    width = width_for(batch, slots)
    pictures, flagged = batch.programs.lanes[width].decode(batch.params, batch.slots.x)
    return np.asarray(pictures), np.asarray(flagged), width


def row_of(batch: Batch, slot: int, width: int) -> int:
    """Where slot `slot` is in the output of a program run at `width` lanes per device."""
    device, lane = divmod(slot, batch.programs.plan.slots_per_device)
    return device * width + lane


def decoded_previews(batch: Batch, slots: list[int], preview: DecodedPreview) -> dict[int, np.ndarray] | None:
    """The pictures of `slots` as their latents stand, from the batch's own decode program (the safety checker's
    flagged pictures black, as the finished ones); None if decoding failed, which costs those previews only."""
    try:
        pictures, flagged, width = run_decode(batch, slots)
    except Exception:
        log.exception("decoding a preview failed")
        return None
    rows = {k: row_of(batch, k, width) for k in slots}
    return {k: preview(np.zeros_like(pictures[row]) if flagged[row] else pictures[row]) for k, row in rows.items()}


def admission(batch: Batch, blank: Job) -> Admission:
    """The host arrays `admit` takes: each slot's new occupant's row where it changes, `blank`'s row elsewhere."""
    rows = []
    for k in range(len(batch.occupant)):
        change = batch.changes.get(k, False)
        rows.append(slot_row(*change) if change else slot_row(blank, 0))
    mask = np.array([k in batch.changes for k in range(len(batch.occupant))])
    stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *rows)
    return Admission(mask=mask, **stacked)


def slot_row(job: Job, index: int) -> dict:
    """Image `index` of `job` as one slot's row of an `Admission`."""
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
        references=job.references,
    )


def result(job: Job) -> GenerationResult:
    """A finished job's pictures, seeds, devices, flags and timings."""
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
        latents=np.stack([job.latents_out[i] for i in order]) if job.latents_out else None,
    )


def emit_previews(batch: Batch, jobs: list[Job], preview: Previewer, every_s: float) -> None:
    """A preview for each job whose last one is `every_s` old: the fitted map over the slots' latents, or the
    batch's own decode program (`DecodedPreview`)."""
    now = time.perf_counter()
    due = [j for j in jobs if now - j.last_preview >= every_s]
    if not due:
        return
    for job in due:
        job.last_preview = now
    slots = {id(job): [k for k, o in enumerate(batch.occupant) if o is not None and o[0] is job] for job in due}
    if isinstance(preview, DecodedPreview):
        pictures = decoded_previews(batch, [k for job in due for k in slots[id(job)]], preview)
        if pictures is None:
            return
    else:
        latents = np.asarray(batch.slots.x)
        pictures = {k: preview(latents[k]) for job in due for k in slots[id(job)]}
    for job in due:
        job.ticket.emit(Preview([pictures[k] for k in slots[id(job)]]))


def hand_back(
    batch: Batch, finished: list[int], pictures: np.ndarray, flagged: np.ndarray, width: int, devices: list[str]
) -> None:
    """Frees the finished slots and gives each its picture (decoded at `width`); a job with all of its pictures
    is finished."""
    per = batch.programs.plan.slots_per_device
    for k in finished:
        job, index = batch.occupant[k]
        batch.occupant[k] = None
        if job.failed:
            continue
        device = k // per
        row = row_of(batch, k, width)
        # A flagged picture never leaves the engine: black in its place, as diffusers does.
        picture = np.zeros_like(pictures[row]) if flagged[row] else pictures[row]
        job.images[index] = (picture, devices[device], bool(flagged[row]))
        if job.ticket.request.return_latents:  # hires fix's first pass: its latents go on to the second
            job.latents_out[index] = np.asarray(batch.slots.x[k])
        if len(job.images) == len(job.seeds):
            job.ticket.emit(Finished(result(job)))


def record_steps(batch: Batch, occupied: list[int], finite: np.ndarray) -> list[tuple[Job, str]]:
    """Notes each occupied slot's steps on its job after a chunk; returns the jobs whose latents diverged (NaN or
    inf), each with the message that fails it: only that request fails."""
    failures = []
    for k in occupied:
        job, index = batch.occupant[k]
        if job.failed or any(job is failed for failed, _ in failures):
            continue
        if not finite[k]:
            failures.append(
                (
                    job,
                    f"image {index + 1} (seed {job.seeds[index]}) diverged: NaN or inf in its latents at step "
                    f"{batch.step[k]}; try another seed, fewer steps or a lower guidance scale",
                )
            )
            continue
        job.steps[index] = batch.step[k]
    return failures
