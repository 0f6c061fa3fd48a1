"""The compiled programs of each `Plan` (admit, advance, decode), kept in a bounded cache and built off-thread.

A plan is a static shape: its three programs are compiled ahead of time, together (each on a thread of
its own), off the serving thread, so that a request for a new size never holds up the batches already
running. The cache keeps at most `max_plans` plans; the least recently used one goes first, never a
pinned one (the warm-up's). A batch keeps its own reference to the programs it runs, so an eviction never breaks it.
The decode reads little of a plan (`decode_plan`): plans that differ only in scheduler, guidance, mode, steps and
the like share one compiled decode per width, held by each plan's lanes and dropped with the last of them.
JAX's persistent compilation cache keeps every program on disk too, so a restart loads instead of compiling.
Programs nobody waits for yet (the warm-up's after Ready: `request(background=True)`) are traced and compiled on
threads of the lowest priority (`cpus.run_when_idle`); the warm-up also asks for them only while the engine is idle
(warmup.py says why a priority alone does not free the cores).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.stages import Compiled, Lowered

from .. import cpus
from ..sampling import pipeline
from ..sampling.pipeline import Plan, Slots

log = logging.getLogger("jax-sd")

# Plans compiled at once: after Ready, the other guidance plan beside the crowd's width; a new size beside either.
COMPILE_PLANS = 2


@functools.cache
def _disk_cache_hits() -> threading.local:
    """Programs JAX loaded from its persistent cache instead of compiling, counted per thread (`.count`) by a
    listener registered on first use: JAX reports a hit on the thread that asked for the program."""
    hits = threading.local()

    def count(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.count = getattr(hits, "count", 0) + 1

    jax.monitoring.register_event_listener(count)
    return hits


def _compile(lowered: Lowered) -> tuple[Compiled, bool]:
    """The program, and whether it was compiled (True) rather than loaded from the disk cache."""
    hits = _disk_cache_hits()
    before = getattr(hits, "count", 0)
    compiled = lowered.compile()
    return compiled, getattr(hits, "count", 0) == before


def decode_plan(plan: Plan) -> Plan:
    """The plan as `pipeline.decode_lanes` sees it: what it reads kept (the family, whose latent format and VAE
    decode; the slots and their devices, which `take_lanes` slices; the latent size), every other field reset.
    Plans equal here decode with the same program, so a new scheduler or guidance on/off compiles no decode."""
    return Plan(
        batch=plan.batch,
        latent_height=plan.latent_height,
        latent_width=plan.latent_width,
        scheduler="",
        max_steps=0,
        guidance=False,
        family=plan.family,
        devices=plan.devices,
    )


class SharedDecode:
    """A compiled decode called as `(params, latents)`, its last arguments (the safety checker's params) bound.

    Every plan whose `decode_plan` and width match holds the same one in its lanes; `Programs` keeps them weakly,
    so one lives exactly as long as a plan (or a batch) that runs it, and evicting a plan never breaks another."""

    __slots__ = ("program", "tail", "__weakref__")

    def __init__(self, program: Compiled, tail: tuple):
        self.program, self.tail = program, tail

    def __call__(self, params, latents):
        return self.program(params, latents, *self.tail)


def lane_widths(slots_per_device: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the slots on a device: the widths a batch's programs come in."""
    widths = [1]
    while widths[-1] < slots_per_device:
        widths.append(min(2 * widths[-1], slots_per_device))
    return tuple(widths)


def ideal_width(plan, needed: int) -> int:
    """The narrowest lane width that holds `needed` slots per device."""
    return min(w for w in lane_widths(plan.slots_per_device) if w >= needed)


@dataclass(frozen=True)
class Lanes:
    """The three programs of one plan at one width (slots run per device)."""

    admit: Compiled  # (params, slots, admission) -> slots
    advance: Compiled  # (params, slots, num_steps) -> (slots, finite [batch])
    decode: Callable  # (params, latents) -> (images [devices * lanes, H, W, 3] in [0, 1], safety flags)
    seconds: float  # compiling (or loading from the disk cache) took this long
    fresh: bool  # at least one program was compiled, not loaded from the disk cache


@dataclass
class CompiledPlan:
    """One plan's programs by width, each compiled when a batch first needs it."""

    plan: Plan
    empty: Callable[[], Slots]  # a batch of empty slots, laid out for these programs
    lanes: dict[int, Lanes]

    def fit(self, needed: int) -> int | None:
        """The narrowest compiled width that holds `needed` lanes; None if none does yet."""
        return min((w for w in self.lanes if w >= needed), default=None)

    @property
    def seconds(self) -> float:
        return sum(lane.seconds for lane in self.lanes.values())

    @property
    def fresh(self) -> bool:
        return any(lane.fresh for lane in self.lanes.values())


class Programs:
    """Plan -> CompiledPlan, bounded, least recently used first out; compiles on background threads."""

    def __init__(
        self,
        graphdef,
        params,
        batch: NamedSharding,
        replicated: NamedSharding,
        example,
        max_plans: int = 8,
        checker: tuple | None = None,
    ):
        """`example(plan)` gives a host `Admission` of empty slots for a plan: the shapes the programs take.
        `checker`: the safety checker's (graphdef, params on the devices) that every decode runs, or None."""
        self.graphdef, self.params = graphdef, params
        self.checker = checker
        self._batch, self._replicated = batch, replicated
        self._example = example
        self.max_plans = max_plans
        self.compile_count = 0  # plans compiled (or loaded from disk) so far, evictions included
        self.decode_compile_count = 0  # decodes compiled (or loaded from disk): plans sharing one count it once
        self._decodes: weakref.WeakValueDictionary[tuple, SharedDecode] = weakref.WeakValueDictionary()
        self._decoding: dict[tuple, Future] = {}  # decodes being compiled, for plans that need them meanwhile
        self._ready: OrderedDict[Plan, CompiledPlan] = OrderedDict()
        self._pending: dict[tuple[Plan, int], Future] = {}
        self._pinned: set[Plan] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_PLANS, thread_name_prefix="jax-sd-compile")
        # Plans nobody waits for: the same work at the lowest priority (the XLA threads they start inherit it)
        self._idle_pool = ThreadPoolExecutor(
            COMPILE_PLANS, thread_name_prefix="jax-sd-compile-idle", initializer=cpus.run_when_idle
        )

    # -- the cache ------------------------------------------------------------------------
    def get(self, plan: Plan) -> CompiledPlan | None:
        """The plan's programs if any width is compiled, marking them recently used; None otherwise."""
        with self._lock:
            compiled = self._ready.get(plan)
            if compiled is not None:
                self._ready.move_to_end(plan)
            return compiled

    def request(
        self,
        plan: Plan,
        width: int,
        on_done: Callable[[Future], None] | None = None,
        pin: bool = False,
        background: bool = False,
    ) -> Future:
        """Starts compiling `plan` at `width` off this thread unless done or under way; its future gives the
        CompiledPlan. `background`: nobody waits for it yet, so it runs at the lowest priority."""
        key = (plan, width)
        with self._lock:
            if pin:
                self._pinned.add(plan)
            compiled = self._ready.get(plan)
            if compiled is not None and width in compiled.lanes:
                future: Future = Future()
                future.set_result(compiled)
            elif key in self._pending:
                future = self._pending[key]
            else:
                future = (self._idle_pool if background else self._pool).submit(self._add, plan, width)
                self._pending[key] = future
        if on_done is not None:
            future.add_done_callback(on_done)
        return future

    def compile(self, plan: Plan, widths: list[int], pin: bool = False) -> CompiledPlan:
        """Blocks until `plan` is compiled at every one of `widths`; raises what compiling raised."""
        futures = [self.request(plan, width, pin=pin) for width in widths]
        return [future.result() for future in futures][-1]

    def pending(self, plan: Plan) -> bool:
        """The plan is being compiled now (for someone else, or by the warm-up)."""
        with self._lock:
            return any(key[0] == plan for key in self._pending)

    @property
    def plans(self) -> list[Plan]:
        """The plans held now, least recently used first."""
        with self._lock:
            return list(self._ready)

    def _add(self, plan: Plan, width: int) -> CompiledPlan:
        try:
            lanes, slots = self._build(plan, width)
        finally:
            with self._lock:
                self._pending.pop((plan, width), None)
        with self._lock:
            compiled = self._ready.get(plan)
            if compiled is None:
                compiled = self._ready[plan] = CompiledPlan(plan, slots, {})
                self.compile_count += 1
                self._evict()
            compiled.lanes = {**compiled.lanes, width: lanes}  # a new dict: readers never see it half-built
            return compiled

    def _evict(self) -> None:
        unpinned = [p for p in self._ready if p not in self._pinned]
        while len(self._ready) > self.max_plans and unpinned:
            del self._ready[unpinned.pop(0)]
            # JAX's own tracing caches hold each plan's jaxprs too; dropping them frees that memory.
            jax.clear_caches()

    # -- building the programs -------------------------------------------------------------
    def _build(self, plan: Plan, width: int) -> tuple[Lanes, Callable[[], Slots]]:
        put = lambda tree, sharding: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )
        admission = put(self._example(plan), self._batch)
        shapes = jax.eval_shape(functools.partial(pipeline.empty_slots, plan, self.graphdef), self.params, admission)
        slots = put(shapes, self._batch)
        steps = jax.ShapeDtypeStruct((), "int32", sharding=self._replicated)
        every = self._batch  # every leaf of slots, admissions and images has the slot axis first
        # Donating the slots lets each chunk update the batch in place: one copy of it, not two.
        donate = () if jax.default_backend() == "cpu" else (4,)

        def lower(fn, *args, out_shardings, donate=()):
            jitted = jax.jit(fn, static_argnums=(0, 1, 2), out_shardings=out_shardings, donate_argnums=donate)
            return jitted.lower(plan, width, self.graphdef, self.params, *args)

        start = time.perf_counter()
        key = (decode_plan(plan), width, slots.x.shape, str(slots.x.dtype))
        with self._lock:  # another plan's decode, done or being compiled, or this build compiles it
            decode = self._decodes.get(key)
            waiting = self._decoding.get(key) if decode is None else None
            mine: Future | None = None
            if decode is None and waiting is None:
                mine = self._decoding[key] = Future()
        try:
            # Tracing holds the GIL, XLA's compiler does not: each program is compiled on a thread of its own
            # (mostly one core each) as soon as it is traced here, the step's first: it compiles longest (on a Zen 3
            # core pair, SD-Turbo's w8a8 step 25-30 s against 7-11 s for the others), and the others are traced
            # while it compiles.
            with ThreadPoolExecutor(3, thread_name_prefix="jax-sd-xla") as pool:
                with jax.set_mesh(every.mesh):  # the programs see the mesh's axes (a core pair: sampling/pairs.py)
                    advancing = pool.submit(
                        _compile, lower(pipeline.advance, slots, steps, out_shardings=(every, every), donate=donate)
                    )
                    admitting = pool.submit(
                        _compile, lower(pipeline.admit, slots, admission, out_shardings=every, donate=donate)
                    )
                    own = []
                    if mine is not None:
                        lowered_decode, decode_args = self._lower_decode(key[0], width, slots.x, every)
                        own.append(pool.submit(_compile, lowered_decode))
                (admit, fresh_admit), (advance, fresh_advance) = admitting.result(), advancing.result()
                own = [future.result() for future in own]
            fresh_decode = bool(own) and own[0][1]
            if mine is not None:
                decode = SharedDecode(own[0][0], decode_args)
                with self._lock:
                    self._decodes[key] = decode
                    self.decode_compile_count += 1
                mine.set_result(decode)
            elif waiting is not None:
                decode = waiting.result()  # raises what compiling it raised
        except BaseException as error:
            if mine is not None and not mine.done():
                mine.set_exception(error)
            raise
        finally:
            if mine is not None:
                with self._lock:
                    self._decoding.pop(key, None)
        lanes = Lanes(
            admit=admit,
            advance=advance,
            decode=decode,
            seconds=time.perf_counter() - start,
            fresh=fresh_admit or fresh_advance or fresh_decode,
        )

        def zeros() -> Slots:
            return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), slots)

        # Where the programs take their slots without donating them (the CPU), no batch changes the empty one: one
        # for every batch of the plan, not 25 arrays made and placed at each batch's start (13 ms of an SDXS picture
        # on 2 Xeon cores).
        kept = None if donate else zeros()

        def empty() -> Slots:
            return kept if kept is not None else zeros()

        return lanes, empty

    def _lower_decode(self, plan: Plan, width: int, latents, every: NamedSharding) -> tuple[Lowered, tuple]:
        """decode_lanes (for a `decode_plan`) with the safety checker's graph folded in (static), lowered, and the
        arguments every call passes after (params, latents): the checker's params, or none without a checker."""
        if self.checker is None:
            fn = functools.partial(pipeline.decode_lanes, checker=None)
            jitted = jax.jit(fn, static_argnums=(0, 1, 2), out_shardings=(every, every))
            return jitted.lower(plan, width, self.graphdef, self.params, latents), ()
        checker_graphdef, checker_params = self.checker

        def decode(plan, width, graphdef, params, latents, checker_params):
            return pipeline.decode_lanes(plan, width, graphdef, params, latents, (checker_graphdef, checker_params))

        jitted = jax.jit(decode, static_argnums=(0, 1, 2), out_shardings=(every, every))
        return jitted.lower(plan, width, self.graphdef, self.params, latents, checker_params), (checker_params,)

    def shutdown(self) -> None:
        for pool in (self._pool, self._idle_pool):
            pool.shutdown(wait=True, cancel_futures=True)  # a compile under way finishes first
