"""What each door shows a client of the request's fields, as plain JSON: the page's controls, `/generate`'s
parameters, the A1111 and OpenAI body schemas (as `/openapi.json` serves them) and MCP's tool schema. The
snapshot test compares these with a copy taken before the doors were derived from `engine.request_fields`,
and the field test reads them to find a new field at every door."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.testclient import TestClient

_PROPS = ("label", "minimum", "maximum", "value", "step", "visible", "choices", "elem_id", "precision", "info")


def page_controls(demo) -> list[dict[str, Any]]:
    """Every component of the page in the order it was made: its kind and what a visitor sees of it."""
    shown = []
    for component in demo.config["components"]:
        props = component["props"]
        entry = {"type": component["type"], **{k: props[k] for k in _PROPS if k in props}}
        shown.append(json.loads(json.dumps(entry, default=str)))
    return shown


def generate_parameters(demo, api_name: str = "generate") -> list[dict[str, Any]]:
    """`/generate`'s parameters as gradio_client sees them: name, default, type, description."""
    api = demo.get_api_info()["named_endpoints"]["/" + api_name]["parameters"]
    keys = ("parameter_name", "parameter_has_default", "parameter_default", "type", "python_type", "label")
    shown = [json.loads(json.dumps({k: p.get(k) for k in keys}, default=str)) for p in api]
    for p in shown:  # a control without a label is named by its id, which counts the components made before it
        p["label"] = re.sub(r"^parameter_\d+$", "parameter_N", str(p["label"]))
    return shown


def doors(site) -> dict[str, Any]:
    """Everything above from a web app (`web.build_app(..., mcp=True)`)."""
    demo = site.state.demo
    with TestClient(site) as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        mcp = client.get("/gradio_api/mcp/schema").json()
    from web.openai_images import body_models

    bodies = {name: schemas[name] for name in ("Txt2ImgRequest", "Img2ImgRequest", "GenerationsBody")}
    bodies["EditsBody"] = body_models()[1].model_json_schema()  # multipart: not in /openapi.json
    return {
        "page": page_controls(demo),
        "generate": generate_parameters(demo),
        "bodies": bodies,
        "mcp": mcp,
    }
