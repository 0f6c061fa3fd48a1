"""ComfyUI's API-format graph (`{"3": {"class_type": "KSampler", "inputs": {...}}, ...}`) read as one engine request.

The nodes are those of the workflows Open WebUI and SillyTavern ship (and FLUX's loaders); comfy_nodes.py's
`NODES` describes each once, for checking a graph and for ComfyUI's `/object_info` alike. A graph is checked as
ComfyUI checks a prompt, and refused in ComfyUI's own shape (`GraphError.body`: `{"error": {...}, "node_errors": {node_id: {"errors",
"dependent_outputs", "class_type"}}}`) when a node is not one of them, an input is missing or of the wrong kind, a
link names a node that is not there, or the links go round in a cycle.

A graph must be one drawing: one KSampler (or a KSamplerAdvanced that adds noise from step 0 to the end) whose model
is the server's (CheckpointLoaderSimple or UNETLoader naming it, through LoraLoaders), whose positive and negative
are CLIPTextEncode, whose latent is an EmptyLatentImage (text to image) or VAEEncode of a LoadImage (image to image
at strength `denoise`), and each SaveImage or PreviewImage saves VAEDecode of its latent, or that picture upscaled
by ImageUpscaleWithModel with one of the server's upscaler networks (UpscaleModelLoader). The model's own text
encoders and VAE draw whatever file a DualCLIPLoader or VAELoader names. The sampler's and the latent's inputs become
the request fields that `request_fields` gives a `comfy` role; ComfyUI's 64-bit seeds are taken modulo 2**32.

Pure: no engine, no files. What the server offers comes in an `Offer` (comfy_nodes.py, with the nodes' table);
`read_graph` returns a `Plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import engine
from engine import request_fields

from .comfy_nodes import (
    ANY_NAME,
    LATENTS,
    LINK_KINDS,
    MAX_NODES,
    MAX_TEXT,
    MODEL_NAMES,
    NAME_SUFFIXES,
    NODES,
    SAMPLERS,
    SEED_INPUT,
    SEED_LIMIT,
    Input,
    Offer,
)


@dataclass(frozen=True)
class Output:
    """A SaveImage or PreviewImage: its node, its folder ("output" or "temp"), its file name prefix, and the upscaler
    network its pictures go through first (ImageUpscaleWithModel), if any."""

    node: str
    folder: str
    prefix: str
    upscaler: str | None = None


@dataclass
class Plan:
    """A graph read as one request: `fields` for `requests.api_request` (prompt among them), the output nodes
    (node id, "output" or "temp", file name prefix), the nodes in the order they run, and which node holds what."""

    fields: dict[str, Any]
    outputs: list[Output]
    order: list[str]
    roles: dict[str, str] = field(default_factory=dict)  # "sampler", "latent", "positive", "negative", "lora", ...
    graph: dict[str, dict] = field(default_factory=dict)  # the nodes that run, with their known inputs (the history's)

    def node_of(self, message: str) -> str | None:
        """The node an engine's refusal is about, by the words it names first."""
        words = (
            ("negative prompt", "negative"),
            ("prompt", "positive"),
            ("LoRA", "lora"),
            ("size", "latent"),
            ("width", "latent"),
            ("height", "latent"),
            ("number of images", "latent"),
            ("image", "picture"),
        )
        for word, role in words:
            if word in message and role in self.roles:
                return self.roles[role]
        return self.roles.get("sampler")


class GraphError(Exception):
    """A graph refused: `body` is ComfyUI's answer to /prompt (HTTP 400)."""

    def __init__(self, kind: str, message: str, node_errors: dict[str, dict] | None = None, details: str = ""):
        self.node_errors = node_errors or {}
        if not details:
            details = "; ".join(
                f"{entry['class_type']} #{nid}: {e['message']}" + (f" ({e['details']})" if e["details"] else "")
                for nid, entry in self.node_errors.items()
                for e in entry["errors"]
            )
        self.error = {"type": kind, "message": message, "details": details, "extra_info": {}}
        super().__init__(f"{message}: {details}" if details else message)

    @property
    def body(self) -> dict[str, Any]:
        return {"error": self.error, "node_errors": self.node_errors}


def _error(kind: str, message: str, details: str = "", **extra) -> dict[str, Any]:
    return {"type": kind, "message": message, "details": details, "extra_info": extra}


def _name(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- the graph's shape ------------------------------------------------------------------------


def _nodes(prompt: Any) -> dict[str, dict]:
    if not isinstance(prompt, dict) or not prompt:
        raise GraphError("invalid_prompt", "prompt must be an object of nodes by id, each with class_type and inputs")
    if len(prompt) > MAX_NODES:
        raise GraphError("invalid_prompt", f"a prompt has at most {MAX_NODES} nodes here, this one {len(prompt)}")
    if any(len(str(nid)) > 64 for nid in prompt):
        raise GraphError("invalid_prompt", "a node's id is at most 64 characters (ComfyUI's are numbers: \"3\")")
    nodes, errors = {}, {}
    for nid, node in prompt.items():
        nid = str(nid)
        kind = node.get("class_type") if isinstance(node, dict) else None
        inputs = node.get("inputs", {}) if isinstance(node, dict) else None
        if not isinstance(kind, str) or not isinstance(inputs, dict):
            problem = _error("invalid_prompt", "a node needs a class_type and an object of inputs")
            errors[nid] = {"errors": [problem], "dependent_outputs": [], "class_type": _name(kind)}
        elif kind not in NODES:
            offered = ", ".join(NODES)
            problem = _error("invalid_prompt", f"node {_name(kind)} is not offered here", f"this server runs {offered}")
            errors[nid] = {"errors": [problem], "dependent_outputs": [], "class_type": kind[:100]}
        else:
            nodes[nid] = {"class_type": kind, "inputs": inputs}
    if errors:
        first = next(iter(errors.values()))["errors"][0]["message"]
        raise GraphError("invalid_prompt", f"Cannot execute because {first}", errors)
    return nodes


def _link(value: Any) -> tuple[str, int] | None:
    if isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[1], int):
        return str(value[0]), value[1]
    return None


def _links(node: dict) -> list[tuple[str, str, int]]:
    """(input, source node, source output) of each link of a node."""
    spec = NODES[node["class_type"]].inputs
    found = []
    for name, value in node["inputs"].items():
        link = _link(value)
        if link is not None and name in spec:
            found.append((name, *link))
    return found


def _cycle(nodes: dict[str, dict]) -> list[str] | None:
    """The nodes of a cycle of links, if there is one."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(nid: str) -> list[str] | None:
        state[nid] = 1
        path.append(nid)
        for _, source, _ in _links(nodes[nid]):
            if source not in nodes:
                continue
            if state.get(source) == 1:
                return path[path.index(source) :]
            if source not in state and (found := walk(source)):
                return found
        path.pop()
        state[nid] = 2
        return None

    for nid in sorted(nodes):
        if nid not in state and (found := walk(nid)):
            return found
    return None


def _ancestors(nodes: dict[str, dict], nid: str) -> set[str]:
    seen, todo = set(), [nid]
    while todo:
        current = todo.pop()
        if current in seen or current not in nodes:
            continue
        seen.add(current)
        todo.extend(source for _, source, _ in _links(nodes[current]))
    return seen


def _order(nodes: dict[str, dict], needed: set[str]) -> list[str]:
    """The needed nodes, each after the nodes it links from (ties by id)."""
    done: list[str] = []
    while len(done) < len(needed):
        ready = [
            nid
            for nid in sorted(needed - set(done), key=lambda n: (len(n), n))
            if all(source in done for _, source, _ in _links(nodes[nid]))
        ]
        done.append(ready[0])
    return done


# ---- the inputs' values --------------------------------------------------------------------------


def _number(value: Any, kind: str) -> float | int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if kind == "INT" else _number(float(value) if abs(value) < 2**1000 else math.inf, kind)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if not isinstance(value, float) or not math.isfinite(value):
        return None
    if kind == "INT":
        return int(value) if value == int(value) else None
    return value


def _check_value(offer: Offer, name: str, spec: Input, value: Any) -> tuple[Any, dict | None]:
    """The value read as its kind, or the error that refuses it."""
    if spec.kind in ("INT", "FLOAT"):
        number = _number(value, spec.kind)
        if number is None:
            whole = "a whole number" if spec.kind == "INT" else "a number"
            return None, _error("invalid_input_type", f"{name} must be {whole}", f"got {_name(value)}", input_name=name)
        if spec.low is not None and number < spec.low:
            return None, _error("value_smaller_than_min", "Value smaller than min", f"{name} {number} < {spec.low}")
        if spec.high is not None and number > spec.high:
            return None, _error("value_bigger_than_max", "Value bigger than max", f"{name} {number} > {spec.high}")
        return number, None
    if spec.kind == "STRING":
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            return None, _error("invalid_input_type", f"{name} must be text", input_name=name)
        if len(str(value)) > MAX_TEXT:
            return None, _error("value_bigger_than_max", "Value bigger than max", f"{name}: over {MAX_TEXT} characters")
        return str(value), None
    if not isinstance(value, str):
        return None, _error("invalid_input_type", f"{name} must be the name of a choice", input_name=name)
    listed = offer.lists.get(spec.choices, ()) if isinstance(spec.choices, str) else spec.choices
    if spec.choices in MODEL_NAMES:
        try:
            offer.check_model(value)
        except engine.InvalidRequest as refused:
            return None, _error("value_not_in_list", "Value not in list", str(refused), input_name=name)
        return value, None
    if spec.choices == "loras":
        stem = next((value[: -len(s)] for s in NAME_SUFFIXES if value.endswith(s)), value)
        if stem not in listed:
            return None, _not_listed(name, value, listed)
        return stem, None
    if spec.choices in ANY_NAME or spec.choices == "uploads":  # an upload is looked up when it is opened
        return value, None
    if value not in listed:
        return None, _not_listed(name, value, listed)
    return value, None


def _not_listed(name: str, value: str, listed: tuple[str, ...]) -> dict:
    offered = ", ".join(listed) if listed else "none"
    return _error(
        "value_not_in_list", "Value not in list", f"{name}: {_name(value)} not in ({offered})", input_name=name
    )


def _check_node(offer: Offer, nodes: dict[str, dict], nid: str) -> tuple[dict[str, Any], list[dict]]:
    """A node's inputs read (links as (node, output)), and its errors."""
    node = nodes[nid]
    values, errors = {}, []
    for name, spec in NODES[node["class_type"]].inputs.items():
        if name not in node["inputs"]:
            if spec.optional:
                values[name] = spec.default
                continue
            errors.append(_error("required_input_missing", "Required input is missing", name, input_name=name))
            continue
        value = node["inputs"][name]
        link = _link(value)
        if spec.kind in LINK_KINDS or link is not None:
            if link is None:
                message = "Bad linked input, must be a length-2 list of [node_id, slot_index]"
                errors.append(_error("bad_linked_input", message, name, input_name=name))
                continue
            source, slot = link
            if source not in nodes:
                message = f"Bad linked input: node {_name(source)} is not in the prompt"
                errors.append(_error("bad_linked_input", message, name, input_name=name))
                continue
            outputs = NODES[nodes[source]["class_type"]].outputs
            given = outputs[slot] if 0 <= slot < len(outputs) else None
            if given != spec.kind:
                message = "Return type mismatch between linked nodes"
                details = f"{name}: wants {spec.kind}, {nodes[source]['class_type']} #{source} output {slot} is {given}"
                errors.append(_error("return_type_mismatch", message, details, input_name=name))
                continue
            values[name] = link
            continue
        read, problem = _check_value(offer, name, spec, value)
        if problem is not None:
            errors.append(problem)
        else:
            values[name] = read
    return values, errors


# ---- the graph read ------------------------------------------------------------------------------


def read_graph(prompt: Any, offer: Offer) -> Plan:
    """The request a graph asks for; raises `GraphError`."""
    nodes = _nodes(prompt)
    cycle = _cycle(nodes)
    if cycle:
        problem = _error("dependency_cycle", "Dependency cycle detected", " -> ".join(cycle + cycle[:1]))
        errors = {
            nid: {"errors": [problem], "dependent_outputs": [], "class_type": nodes[nid]["class_type"]} for nid in cycle
        }
        raise GraphError("dependency_cycle", "Dependency cycle detected: the graph's links go round", errors)
    outputs = [nid for nid, node in nodes.items() if NODES[node["class_type"]].output_node]
    if not outputs:
        raise GraphError("prompt_no_outputs", "Prompt has no outputs", details="add a SaveImage node")
    needed: dict[str, set[str]] = {}  # each node an output needs -> the outputs that need it
    for output in outputs:
        for nid in _ancestors(nodes, output):
            needed.setdefault(nid, set()).add(output)
    values, errors = {}, {}
    for nid in sorted(needed):
        values[nid], problems = _check_node(offer, nodes, nid)
        if problems:
            errors[nid] = _entry(nodes, nid, problems, needed)
    if errors:
        raise GraphError("prompt_outputs_failed_validation", "Prompt outputs failed validation", errors)
    return _drawing(offer, nodes, values, outputs, needed)


def _entry(nodes, nid: str, problems: list[dict], needed: dict[str, set[str]]) -> dict:
    return {
        "errors": problems,
        "dependent_outputs": sorted(needed.get(nid, ())),
        "class_type": nodes[nid]["class_type"],
    }


class _Refusal(Exception):
    def __init__(self, nid: str, message: str):
        self.nid, self.message = nid, message


def _drawing(offer: Offer, nodes, values, outputs: list[str], needed) -> Plan:
    """The one drawing the checked graph describes; a shape that is not one is refused at the node that breaks it."""
    try:
        plan = _read_drawing(offer, nodes, values, outputs)
    except _Refusal as refused:
        problem = _error("not_supported", refused.message, input_name="")
        errors = {refused.nid: _entry(nodes, refused.nid, [problem], needed)}
        raise GraphError("prompt_outputs_failed_validation", "Prompt outputs failed validation", errors) from None
    plan.order = _order(nodes, set(needed))
    for nid in plan.order:
        spec = NODES[_class(nodes, nid)].inputs
        known = {name: value for name, value in nodes[nid]["inputs"].items() if name in spec}
        plan.graph[nid] = {"class_type": _class(nodes, nid), "inputs": known}
    return plan


def _class(nodes, nid: str) -> str:
    return nodes[nid]["class_type"]


def _read_drawing(offer: Offer, nodes, values, outputs: list[str]) -> Plan:
    samplers = sorted({nid for nid in values if _class(nodes, nid) in SAMPLERS})
    if len(samplers) != 1:
        where = samplers[1] if samplers else outputs[0]
        raise _Refusal(where, "this server draws one KSampler per prompt, whose pictures VAEDecode makes")
    sampler = samplers[0]
    roles = {"sampler": sampler}
    saved = []
    for nid in outputs:
        source, upscaler = values[nid]["images"][0], None
        if _class(nodes, source) == "ImageUpscaleWithModel":
            upscaler = values[values[source]["upscale_model"][0]]["model_name"]
            source = values[source]["image"][0]
        if _class(nodes, source) != "VAEDecode" or values[source]["samples"][0] != sampler:
            message = (
                f"{_class(nodes, nid)} here saves VAEDecode of the KSampler's latent (or its ImageUpscaleWithModel)"
            )
            raise _Refusal(nid, message)
        kind = "output" if _class(nodes, nid) == "SaveImage" else "temp"
        saved.append(Output(nid, kind, values[nid].get("filename_prefix") or "ComfyUI", upscaler))
    s = values[sampler]
    if _class(nodes, sampler) == "KSamplerAdvanced":
        whole = s["add_noise"] == "enable" and s["start_at_step"] == 0 and s["end_at_step"] >= s["steps"]
        if not whole or s["return_with_leftover_noise"] != "disable":
            message = (
                "KSamplerAdvanced is taken as a whole drawing only: add_noise enable, start_at_step 0, end_at_step at "
                "least steps, return_with_leftover_noise disable"
            )
            raise _Refusal(sampler, message)
    loras = _loras(nodes, values, sampler, roles)
    texts = {}
    for side in ("positive", "negative"):
        source = s[side][0]
        if _class(nodes, source) != "CLIPTextEncode":
            raise _Refusal(sampler, f"{side} must be a CLIPTextEncode here")
        texts[side] = values[source]["text"]
        roles[side] = source
    try:
        kind = offer.scheduler(s["sampler_name"], s["scheduler"])
    except engine.InvalidRequest as refused:
        raise _Refusal(sampler, str(refused)) from None
    own = {"sampler": s, "latent": {}}
    fields: dict[str, Any] = {"prompt": texts["positive"], "negative_prompt": texts["negative"], "scheduler": kind}
    latent = s["latent_image"][0]
    denoise = s.get("denoise", 1.0)
    if _class(nodes, latent) in LATENTS:
        roles["latent"] = latent
        own["latent"] = values[latent]
        if denoise < 1:
            message = "denoise below 1 redraws part of a picture: give the sampler VAEEncode(LoadImage) as latent_image"
            raise _Refusal(sampler, message)
    elif _class(nodes, latent) == "VAEEncode" and _class(nodes, values[latent]["pixels"][0]) == "LoadImage":
        picture = values[latent]["pixels"][0]
        roles["picture"] = picture
        try:
            fields["image"] = offer.picture(values[picture]["image"])
        except engine.InvalidRequest as refused:
            raise _Refusal(picture, str(refused)) from None
    else:
        raise _Refusal(sampler, "latent_image must be an EmptyLatentImage, or VAEEncode of a LoadImage")
    s = dict(s, seed=s[SEED_INPUT[_class(nodes, sampler)]] % SEED_LIMIT)
    own["sampler"] = s
    for f in request_fields.current():  # the fields ComfyUI's graph holds, by the node role and input they come from
        if f.comfy is None:
            continue
        role, name = f.comfy
        if name in own[role] and not (f.needs_image and "image" not in fields):
            fields[f.name] = own[role][name]
    if loras:
        fields["lora_scales"] = loras
    return Plan(fields=fields, outputs=saved, order=[], roles=roles)


def _loras(nodes, values, sampler: str, roles: dict[str, str]) -> dict[str, float]:
    """The LoRAs between the sampler and its model's loader, by name -> weight (one weight each: ours are one)."""
    weights: dict[str, float] = {}
    source = values[sampler]["model"][0]
    while _class(nodes, source) == "LoraLoader":
        lora = values[source]
        roles.setdefault("lora", source)
        if lora["strength_clip"] != lora["strength_model"]:
            raise _Refusal(source, "strength_clip must equal strength_model here: a LoRA has one weight")
        if lora["lora_name"] in weights:
            raise _Refusal(source, f"LoRA {_name(lora['lora_name'])} is loaded twice")
        weights[lora["lora_name"]] = lora["strength_model"]
        source = lora["model"][0]
    return weights


def refused(prompt: dict, plan: Plan, message: str) -> GraphError:
    """The engine's refusal of a read graph (a size not offered, too many steps, ...), at the node it is about."""
    nid = plan.node_of(message) or plan.outputs[0].node
    problem = _error("value_not_valid", message)
    kind = {str(k): v for k, v in prompt.items()}[nid]["class_type"]
    entry = {"errors": [problem], "dependent_outputs": [out.node for out in plan.outputs], "class_type": kind}
    return GraphError("prompt_outputs_failed_validation", "Prompt outputs failed validation", {nid: entry})
