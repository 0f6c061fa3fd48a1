"""ComfyUI's API over the engine, for the clients that speak it (Open WebUI's and SillyTavern's ComfyUI engines, and
the many scripts written against ComfyUI's `/prompt`). Read ComfyUI's `server.py` and `execution.py` for the original.

- `POST /prompt`: an API-format graph (comfy_graph.py reads it as one request) is checked and handed to the engine
  at once, under the caller's share, as A1111's and OpenAI's requests are; the answer is `{"prompt_id", "number",
  "node_errors"}`, or ComfyUI's refusal (400) naming the node. The drawing goes on after the answer.
- `/ws?clientId=`: the caller's prompts sent with that client_id tell their progress there as ComfyUI does: `status`,
  `execution_start`, `execution_cached`, `executing` (each node; `null` once the prompt is done and in the history),
  `progress` {value, max}, binary previews (ComfyUI's PREVIEW_IMAGE frames, a PNG; none for a caller that cannot be
  told apart from others), `executed` (a SaveImage's pictures), `execution_success` (or `execution_error`,
  `execution_interrupted`).
- `GET /history[/{id}]`, `GET/POST /queue`, `POST /interrupt`: the caller's own prompts only (callers.py), as
  A1111's `/progress` and `/interrupt` answer about the caller's own requests.
- `GET /view`: a picture this server drew or was sent (`POST /upload/image`), looked up by name among the caller's
  own, kept in memory (`Pictures`): a client's name is never a path, so nothing else can be read through it.
- `GET /object_info[/{node}]`: the nodes offered, with the server's model, LoRAs, samplers, schedulers, upscaler
  networks (ImageUpscaleWithModel runs a drawing's pictures through one, at its own scale) and the caller's uploads;
  `GET /system_stats`: the devices, and the networks' dtype and compute path.
Every route is also under `/api`; the gate (api_gate.py) holds them to the same credentials and body limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import platform
import re
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.websockets import WebSocketDisconnect

import engine

from . import comfy_graph, comfy_nodes, names
from .a1111 import check_model, model_title
from .api_common import ApiJob, ApiJobs, caller_of, opaque, preview_png, read_picture, result_pngs
from .api_gate import ApiError, incident
from .callers import Caller
from .callers import caller_of as scope_caller
from .pictures import default_max_pixels
from .requests import api_request

PICTURES_MAX_BYTES = 256 * 2**20  # the pictures /view serves, drawn and uploaded, the oldest dropped first
MAX_HISTORY = 256  # finished prompts remembered, the oldest dropped first
SOCKET_BACKLOG = 256  # messages waiting for a slow socket; beyond it progress and previews are dropped
PREVIEW_FRAME = (1).to_bytes(4, "big") + (2).to_bytes(4, "big")  # ComfyUI's PREVIEW_IMAGE event, a PNG
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
FOLDERS = ("output", "input", "temp")
NOT_HERE = "no such picture here: /view serves only the pictures this server drew or was sent, for a while"


def _safe(name: str, fallback: str) -> str:
    """A file name made of plain characters only (a client's prefix or upload name is never a path)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\- ]", "_", name.replace("\\", "/").rsplit("/", 1)[-1]).strip(" .")
    return cleaned[:64] or fallback


class Pictures:
    """The pictures /view serves, by (folder, name) and owner, in memory, at most `max_bytes` of them."""

    def __init__(self, max_bytes: int = PICTURES_MAX_BYTES):
        self.max_bytes = max_bytes
        self._files: OrderedDict[tuple[str, str], tuple[str, bytes, str]] = OrderedDict()  # -> owner, data, media
        self._bytes = 0

    def add(self, owner: Caller, folder: str, name: str, data: bytes, media: str = "image/png") -> None:
        self._files[(folder, name)] = (owner.name, data, media)
        self._bytes += len(data)
        while self._bytes > self.max_bytes and len(self._files) > 1:
            _, (_, old, _) = self._files.popitem(last=False)
            self._bytes -= len(old)

    def get(self, owner: Caller, folder: str, name: str) -> tuple[bytes, str] | None:
        entry = self._files.get((folder, name))
        if entry is None or entry[0] != owner.name:
            return None
        return entry[1], entry[2]

    def names(self, owner: Caller, folder: str) -> tuple[str, ...]:
        return tuple(name for (kind, name), entry in self._files.items() if kind == folder and entry[0] == owner.name)


@dataclass(eq=False)
class Prompt:
    """One prompt: its graph (the nodes that run), its plan, its job in the engine, and what the history shows."""

    id: str
    number: int
    caller: Caller
    client_id: str | None
    graph: dict
    plan: comfy_graph.Plan
    job: ApiJob
    outputs: dict[str, Any] = field(default_factory=dict)
    messages: list[list] = field(default_factory=list)
    status: str = "running"
    started: bool = False

    def entry(self) -> list:
        """ComfyUI's queue entry: [number, id, graph, extra_data, output node ids]."""
        return [self.number, self.id, self.graph, {"client_id": self.client_id}, [o.node for o in self.plan.outputs]]

    def history(self) -> dict[str, Any]:
        return {
            "prompt": self.entry(),
            "outputs": self.outputs,
            "status": {"status_str": self.status, "completed": self.status == "success", "messages": self.messages},
            "meta": {nid: {"node_id": nid, "display_node": nid} for nid in self.outputs},
        }


class Sockets:
    """The open `/ws` sockets, by caller and client id; messages are queued to each and sent by its own task."""

    def __init__(self):
        self._queues: dict[tuple[str, str], list[asyncio.Queue]] = {}

    def _listening(self, caller: Caller, client_id: str | None) -> list[asyncio.Queue]:
        keys = [key for key in self._queues if key[0] == caller.name and (client_id is None or key[1] == client_id)]
        return [queue for key in keys for queue in self._queues[key]]

    def send(self, caller: Caller, client_id: str | None, kind: str, data: dict) -> None:
        for queue in self._listening(caller, client_id):
            if queue.qsize() < SOCKET_BACKLOG or kind != "progress":
                queue.put_nowait({"type": kind, "data": data})

    def send_preview(self, caller: Caller, client_id: str | None, preview) -> None:
        """ComfyUI's binary preview frame (event 1, PREVIEW_IMAGE; format 2, PNG), to sockets that keep up;
        `preview()` makes the PNG, only when someone listens."""
        listening = [queue for queue in self._listening(caller, client_id) if queue.qsize() < SOCKET_BACKLOG]
        png = preview() if listening else None
        for queue in listening if png else ():
            queue.put_nowait(PREVIEW_FRAME + png)

    async def serve(self, socket: WebSocket, caller: Caller, client_id: str, status: dict) -> None:
        await socket.accept()
        queue: asyncio.Queue = asyncio.Queue()
        key = (caller.name, client_id)
        self._queues.setdefault(key, []).append(queue)
        queue.put_nowait({"type": "status", "data": {"status": status, "sid": client_id}})
        sender = asyncio.create_task(_send_each(socket, queue))
        listener = asyncio.create_task(_until_closed(socket))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sender.cancel()
            listener.cancel()
            self._queues[key].remove(queue)
            if not self._queues[key]:
                del self._queues[key]


async def _send_each(socket: WebSocket, queue: asyncio.Queue) -> None:
    while True:
        message = await queue.get()
        if isinstance(message, bytes):
            await socket.send_bytes(message)
        else:
            await socket.send_text(json.dumps(message))


async def _until_closed(socket: WebSocket) -> None:
    try:
        while (await socket.receive())["type"] != "websocket.disconnect":
            pass  # a client's own messages (feature flags) change nothing here
    except WebSocketDisconnect:
        return


def _stamp() -> int:
    return int(time.time() * 1000)


class ComfyDoor:
    """The state behind the routes: prompts, history, pictures and sockets."""

    def __init__(self, pipe: engine.EngineFace, jobs: ApiJobs, max_pixels: int):
        self.pipe, self.jobs, self.max_pixels = pipe, jobs, max_pixels
        self.pictures = Pictures()
        self.sockets = Sockets()
        self.running: list[Prompt] = []
        self.finished: OrderedDict[str, Prompt] = OrderedDict()
        self.numbers = itertools.count()
        self.files = itertools.count(1)  # the pictures' numbers in their names, as ComfyUI's ComfyUI_00001_.png
        self._tasks: set[asyncio.Task] = set()

    # -- what is offered ---------------------------------------------------------------------------

    def offer(self, caller: Caller) -> comfy_nodes.Offer:
        title = model_title(self.pipe)
        lists = {
            "checkpoints": (title,),
            "unets": (title,),
            "text_encoders": (title,),
            "vaes": (getattr(self.pipe, "vae_name", None) or title,),
            "loras": tuple(getattr(self.pipe.limits, "loras", ())),
            "samplers": tuple(names.comfy_samplers(self.pipe)),
            "schedulers": tuple(names.comfy_schedulers(self.pipe)),
            "upscalers": tuple(getattr(getattr(self.pipe, "upscalers", None), "entries", None) or ()),
            "uploads": self.pictures.names(caller, "input"),
        }
        return comfy_nodes.Offer(
            lists=lists,
            check_model=lambda name: check_model(self.pipe, name),
            scheduler=lambda sampler, schedule: names.comfy_scheduler(self.pipe, sampler, schedule),
            picture=lambda name: self._upload(caller, name),
        )

    def _upload(self, caller: Caller, name: str) -> Any:
        """LoadImage's picture: one the caller uploaded ("name", or "name [input]" as ComfyUI annotates it)."""
        match = re.fullmatch(r"(.*?)\s*\[(output|input|temp)\]", name)
        folder, name = (match.group(2), match.group(1)) if match else ("input", name)
        found = self.pictures.get(caller, folder, name)
        if found is None:
            raise engine.InvalidRequest("image is not a picture uploaded here: send it to /upload/image first")
        return opaque(read_picture(found[0], "image", self.max_pixels))

    def queue_remaining(self, caller: Caller) -> dict:
        mine = sum(1 for p in self.running if p.caller.name == caller.name)
        return {"exec_info": {"queue_remaining": mine}}

    # -- a prompt's life ---------------------------------------------------------------------------

    def submit(self, caller: Caller, graph: dict, client_id: str | None, plan: comfy_graph.Plan) -> Prompt:
        """Submits a read graph (on the event loop); raises GraphError, engine.Busy or CallerBusy."""
        fields = dict(plan.fields)
        try:
            request = api_request(fields.pop("prompt"), **fields)
            job = self.jobs.start(self.pipe, request, caller)
        except engine.InvalidRequest as refused:
            raise comfy_graph.refused(graph, plan, str(refused)) from None
        prompt = Prompt(str(uuid.uuid4()), next(self.numbers), caller, client_id, plan.graph, plan, job)
        self.running.append(prompt)
        task = asyncio.create_task(self._follow(prompt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._tell(prompt, "status", {"status": self.queue_remaining(caller)}, everyone=True)
        return prompt

    def _tell(self, prompt: Prompt, kind: str, data: dict, everyone: bool = False, keep: bool = False) -> None:
        if keep:
            prompt.messages.append([kind, data])
        self.sockets.send(prompt.caller, None if everyone else prompt.client_id, kind, data)

    def _start(self, prompt: Prompt) -> None:
        """The nodes before the sampler run at once: their messages go out when the drawing starts."""
        prompt.started = True
        ident = {"prompt_id": prompt.id}
        self._tell(prompt, "execution_start", {**ident, "timestamp": _stamp()}, keep=True)
        self._tell(prompt, "execution_cached", {"nodes": [], **ident, "timestamp": _stamp()}, keep=True)
        sampler = prompt.plan.roles["sampler"]
        for nid in prompt.plan.order[: prompt.plan.order.index(sampler) + 1]:
            self._tell(prompt, "executing", {"node": nid, "display_node": nid, **ident})

    def _heard(self, prompt: Prompt, event: engine.Event) -> None:
        if isinstance(event, engine.Progress):
            if not prompt.started:
                self._start(prompt)
            sampler = prompt.plan.roles["sampler"]
            data = {"value": event.step, "max": event.total, "prompt_id": prompt.id, "node": sampler}
            self._tell(prompt, "progress", data)
        elif isinstance(event, engine.Preview) and not prompt.caller.shared:  # a shared caller's may be another's
            self.sockets.send_preview(prompt.caller, prompt.client_id, lambda: preview_png(prompt.job))

    async def _follow(self, prompt: Prompt) -> None:
        try:
            await self.jobs.follow(prompt.job, None, lambda event: self._heard(prompt, event))
            await self._finish(prompt)
        except Exception as error:  # noqa: BLE001 - a prompt's end is told whatever breaks; the log keeps why
            self._fail(prompt, "internal", incident(error, "ComfyUI API"))
        finally:
            if prompt in self.running:
                self.running.remove(prompt)
            self.finished[prompt.id] = prompt
            while len(self.finished) > MAX_HISTORY:
                self.finished.popitem(last=False)
            ident = {"prompt_id": prompt.id}
            self._tell(prompt, "executing", {"node": None, "display_node": None, **ident})
            self._tell(prompt, "status", {"status": self.queue_remaining(prompt.caller)}, everyone=True)

    async def _finish(self, prompt: Prompt) -> None:
        job = prompt.job
        if not prompt.started:
            self._start(prompt)
        if isinstance(job.error, engine.Cancelled):
            data = {"prompt_id": prompt.id, "node_id": prompt.plan.roles["sampler"], "executed": [], "timestamp": 0}
            data["node_type"] = prompt.graph[data["node_id"]]["class_type"]
            prompt.status = "error"
            self._tell(prompt, "execution_interrupted", data, keep=True)
            return
        if isinstance(job.error, engine.InvalidRequest):
            self._fail(prompt, "InvalidRequest", str(job.error))
            return
        if job.error is not None or job.result is None:
            self._fail(prompt, "internal", incident(job.error or RuntimeError("no result"), "ComfyUI API"))
            return
        pngs = await asyncio.to_thread(result_pngs, job.result, self.pipe.model_name)
        ident = {"prompt_id": prompt.id}
        sampler = prompt.plan.roles["sampler"]
        for nid in prompt.plan.order[prompt.plan.order.index(sampler) + 1 :]:
            self._tell(prompt, "executing", {"node": nid, "display_node": nid, **ident})
            out = next((out for out in prompt.plan.outputs if out.node == nid), None)
            if out is None:
                continue
            try:
                files = pngs if out.upscaler is None else await asyncio.to_thread(self._upscaled, job.result, out)
            except engine.InvalidRequest as refused:
                self._fail(prompt, "InvalidRequest", str(refused))
                return
            images = []
            for png, _, _ in files:
                name = f"{_safe(out.prefix, 'ComfyUI')}_{next(self.files):05}_{secrets.token_hex(4)}_.png"
                self.pictures.add(prompt.caller, out.folder, name, png)
                images.append({"filename": name, "subfolder": "", "type": out.folder})
            prompt.outputs[nid] = {"images": images}
            self._tell(prompt, "executed", {"node": nid, "display_node": nid, "output": {"images": images}, **ident})
        prompt.status = "success"
        self._tell(prompt, "execution_success", {**ident, "timestamp": _stamp()}, keep=True)

    def _upscaled(self, result: engine.GenerationResult, out: comfy_graph.Output) -> list[tuple[bytes, int, bool]]:
        """The pictures through an upscaler network at its own scale (ImageUpscaleWithModel), as PNGs."""
        scale = self.pipe.upscalers.entries[out.upscaler].scale
        images = [self.pipe.upscale(im, im.width * scale, im.height * scale, out.upscaler) for im in result.images]
        return result_pngs(dataclasses.replace(result, images=images), self.pipe.model_name)

    def _fail(self, prompt: Prompt, kind: str, message: str) -> None:
        sampler = prompt.plan.roles["sampler"]
        data = {
            "prompt_id": prompt.id,
            "node_id": sampler,
            "node_type": prompt.graph[sampler]["class_type"],
            "executed": [],
            "exception_message": message,
            "exception_type": kind,
            "traceback": [],
            "current_inputs": {},
            "current_outputs": {},
            "timestamp": _stamp(),
        }
        prompt.status = "error"
        self._tell(prompt, "execution_error", data, keep=True)

    def mine(self, caller: Caller, prompts) -> list[Prompt]:
        return [p for p in prompts if p.caller.name == caller.name]


# ---- the routes -------------------------------------------------------------------------------------


def _graph_body(raw: bytes) -> tuple[Any, str | None]:
    """The graph and client_id of /prompt's body (JSON, whatever its Content-Type: SillyTavern sends none)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict) or "prompt" not in body:
        raise ApiError(400, 'the body must be JSON: {"prompt": {...}, "client_id": "..."}', code="invalid_prompt")
    client_id = body.get("client_id")
    return body["prompt"], client_id[:128] if isinstance(client_id, str) else None


async def _json(http: Request) -> dict:
    try:
        body = json.loads(await http.body() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body must be JSON", code="invalid_prompt") from None
    return body if isinstance(body, dict) else {}


def comfy_router(pipe: engine.EngineFace, jobs: ApiJobs, max_pixels: int | None = None) -> APIRouter:
    """The routes and the socket, at "/" and under "/api"; `max_pixels`: an upload over this is refused."""
    door = ComfyDoor(pipe, jobs, max_pixels or default_max_pixels(pipe.limits))
    router = APIRouter(tags=["ComfyUI"])

    async def prompt(http: Request):
        graph, client_id = _graph_body(await http.body())
        caller = caller_of(http)
        try:  # reading opens the uploads a graph names: off the event loop
            plan = await asyncio.to_thread(comfy_graph.read_graph, graph, door.offer(caller))
            queued = door.submit(caller, graph, client_id, plan)
        except comfy_graph.GraphError as refused:
            return JSONResponse(status_code=400, content=refused.body)
        return {"prompt_id": queued.id, "number": queued.number, "node_errors": {}}

    async def prompt_info(http: Request):
        return {"exec_info": door.queue_remaining(caller_of(http))["exec_info"]}

    async def history(http: Request, max_items: int | None = None):
        mine = door.mine(caller_of(http), door.finished.values())
        if max_items is not None:
            mine = mine[-max_items:] if max_items > 0 else []
        return {p.id: p.history() for p in mine}

    async def history_of(prompt_id: str, http: Request):
        found = door.finished.get(prompt_id)
        return {found.id: found.history()} if found and found.caller.name == caller_of(http).name else {}

    async def change_history(http: Request):
        body, caller = await _json(http), caller_of(http)
        gone = [p.id for p in door.mine(caller, door.finished.values())] if body.get("clear") else []
        gone += [i for i in body.get("delete", []) if isinstance(i, str)]
        for ident in gone:
            if ident in door.finished and door.finished[ident].caller.name == caller.name:
                del door.finished[ident]
        return {}

    async def queue(http: Request):
        mine = door.mine(caller_of(http), door.running)
        return {
            "queue_running": [p.entry() for p in mine if p.started],
            "queue_pending": [p.entry() for p in mine if not p.started],
        }

    async def change_queue(http: Request):
        body, caller = await _json(http), caller_of(http)
        waiting = [p for p in door.mine(caller, door.running) if not p.started]
        named = set(i for i in body.get("delete", []) if isinstance(i, str))
        for p in waiting:
            if body.get("clear") or p.id in named:
                p.job.ticket.cancel()
        return {}

    async def interrupt(http: Request):
        body, caller = await _json(http), caller_of(http)
        named = body.get("prompt_id")
        for p in door.mine(caller, door.running):
            if (p.started and named is None) or p.id == named:
                p.job.ticket.cancel()
        return {}

    async def upload(http: Request):
        form = await http.form()
        try:
            files = [v for k, v in form.multi_items() if k == "image" and not isinstance(v, str)]
            if len(files) != 1:
                raise ApiError(400, "send one picture as the multipart file field image", code="invalid_prompt")
            data, given = await files[0].read(), files[0].filename or "image.png"
            folder = form.get("type") if form.get("type") in FOLDERS else "input"
        finally:
            await form.close()
        picture = await asyncio.to_thread(read_picture, data, "image", door.max_pixels)
        stem, dot, ext = _safe(given, "image.png").rpartition(".")
        name = f"{stem or ext}_{secrets.token_hex(4)}.{ext if dot else 'png'}"
        door.pictures.add(caller_of(http), folder, name, data, MEDIA.get(picture.format, "image/png"))
        return {"name": name, "subfolder": "", "type": folder}

    async def view(http: Request, filename: str = "", subfolder: str = "", type: str = "output"):  # noqa: A002
        found = door.pictures.get(caller_of(http), type, filename) if not subfolder else None
        if found is None:
            raise ApiError(404, NOT_HERE, code="not_found")
        data, media = found
        return Response(data, media_type=media, headers={"Cache-Control": "private, max-age=600"})

    async def object_info_of(node: str, http: Request):
        info = comfy_nodes.object_info(door.offer(caller_of(http)))
        return {node: info[node]} if node in info else {}

    async def system_stats():
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = free = 0
        devices = [
            {"name": name, "type": name.split(":")[0], "index": i, "vram_total": 0, "vram_free": 0}
            | {"torch_vram_total": 0, "torch_vram_free": 0}
            for i, name in enumerate(pipe.devices)
        ]
        system = {"os": os.name, "ram_total": ram, "ram_free": free, "comfyui_version": "jax-sd"}
        system |= {"python_version": platform.python_version(), "pytorch_version": "", "embedded_python": False}
        system |= {"argv": [], "jax_sd_model": model_title(pipe)}
        system |= {
            "jax_sd_dtype": getattr(pipe, "dtype", None),
            "jax_sd_compute_path": getattr(pipe, "compute_path", None),
        }
        return {"system": system, "devices": devices}

    async def socket(websocket: WebSocket, clientId: str | None = None):  # noqa: N803 - ComfyUI's parameter
        caller = scope_caller(websocket.scope)
        client_id = (clientId or secrets.token_hex(16))[:128]
        await door.sockets.serve(websocket, caller, client_id, door.queue_remaining(caller))

    async def object_info(http: Request):  # LoadImage's choices: the caller's own uploads
        return comfy_nodes.object_info(door.offer(caller_of(http)))

    routes = (
        ("/prompt", prompt, ["POST"]),
        ("/prompt", prompt_info, ["GET"]),
        ("/history", history, ["GET"]),
        ("/history", change_history, ["POST"]),
        ("/history/{prompt_id}", history_of, ["GET"]),
        ("/queue", queue, ["GET"]),
        ("/queue", change_queue, ["POST"]),
        ("/interrupt", interrupt, ["POST"]),
        ("/upload/image", upload, ["POST"]),
        ("/view", view, ["GET"]),
        ("/object_info", object_info, ["GET"]),
        ("/object_info/{node}", object_info_of, ["GET"]),
        ("/system_stats", system_stats, ["GET"]),
    )
    for prefix in ("", "/api"):
        for path, route, methods in routes:
            router.add_api_route(prefix + path, route, methods=methods)
        router.add_api_websocket_route(prefix + "/ws", socket)
    return router
