"""The web layer of jax-sd: every door through which people reach the engine, served as one FastAPI app.

Here live the Gradio page (page.py: widgets and wiring; handlers.py: what its events do, over plain values),
the parsing of raw page or JSON values into an `engine.GenerationRequest` (requests.py, shared by every
door; it raises `engine.InvalidRequest`, which each door turns into its own refusal), the engine face the
web layer reads (`engine.EngineFace`, which `engine.Engine` and `cluster.RemoteEngine` both have), and
the app itself (server.py: `build_app` mounts the page at "/" on a FastAPI app, REST routers go before it;
`serve` runs it with uvicorn), and the REST APIs beside the page: AUTOMATIC1111's (a1111.py, its wire models
in a1111_models.py), OpenAI's Images API (openai_images.py) and ComfyUI's (comfy.py: its API-format graphs read as
one request in comfy_graph.py, over the nodes described in comfy_nodes.py), their foreign names mapped to ours in
one place (names.py), their shared pictures and running requests (api_common.py) and their gate (api_gate.py: access,
body limits, error shapes; throttle.py: failed logins per address, the page's and the APIs'; hosts.py: the Host
names it answers to; callers.py: who a caller is, X-Forwarded-For from trusted proxies, each caller's share). Code here imports the engine only through its public face, `import engine` /
`from engine import ...`, with one exception: `engine.compat.pnginfo`, for the PNG parameters the pictures
carry. Never the engine's internals, and never Ray: `python app.py` and the cluster's ingress serve the
same `build_app`.
"""

from .api_gate import DEFAULT_MAX_BODY_MB, read_api_keys, read_auth
from .callers import DEFAULT_MAX_REQUESTS, DEFAULT_MAX_WORK, read_forwarded_allow_ips
from .hosts import allowed_hosts, read_allowed_hosts
from .page import API_NAME, THEME, create_demo
from .server import build_app, serve

__all__ = [
    "API_NAME",
    "DEFAULT_MAX_BODY_MB",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_MAX_WORK",
    "THEME",
    "allowed_hosts",
    "build_app",
    "create_demo",
    "read_allowed_hosts",
    "read_api_keys",
    "read_auth",
    "read_forwarded_allow_ips",
    "serve",
]
