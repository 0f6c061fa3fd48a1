"""The one web app: a FastAPI app with the Gradio page mounted at "/" (`build_app`), and `serve` to run it.

`python app.py` serves it with uvicorn; the cluster's ingress (cluster/ingress.py) hands the same app to
Ray Serve. Gradio's `gr.mount_gradio_app` starts the page's queue with the app's lifespan.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading

import gradio as gr
from fastapi import FastAPI
from gradio.utils import get_space

import engine

from .a1111 import a1111_router
from .api_common import ApiJobs
from .api_gate import DEFAULT_MAX_BODY_MB, ApiAccess, ApiGate, install_error_handlers
from .callers import DEFAULT_MAX_REQUESTS, DEFAULT_MAX_WORK, CallerLimits, ForwardedFor
from .comfy import comfy_router
from .hosts import HostCheck
from .openai_images import openai_router
from .page import THEME, create_demo
from .pictures import PICTURE_TTL_S, ClientFiles, default_max_pixels
from .throttle import LoginGuard, LoginThrottle

log = logging.getLogger("jax-sd")

AUTH_MESSAGE = "This jax-sd page is for invited users: log in with the name and password you were given."
QUEUE_SIZE = 48  # requests waiting in the page's queue; more are refused at once
SHUTDOWN_GRACE_S = 2  # on Ctrl-C or SIGTERM, open streams (pages, API clients) get this long, then are cut


def _paths(given: list[str] | None, variable: str) -> list[str]:
    # As Gradio's launch reads them: the list given, else a comma-separated environment variable.
    if given:
        return list(given)
    return [item.strip() for item in os.environ.get(variable, "").split(",") if item.strip()]


def build_app(
    engine: engine.EngineFace,
    *,
    images_per_device: int = 1,
    concurrency: int | None = None,
    queue_size: int = QUEUE_SIZE,
    auth: list[tuple[str, str]] | None = None,
    mcp: bool = False,
    allowed_paths: list[str] | None = None,
    blocked_paths: list[str] | None = None,
    api_keys: list[str] | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    max_picture_pixels: int | None = None,
    login_throttle: LoginThrottle | None = None,
    allowed_hosts: frozenset[str] | None = None,
    picture_ttl_s: float = PICTURE_TTL_S,
    max_caller_requests: int = DEFAULT_MAX_REQUESTS,
    max_caller_work: int = DEFAULT_MAX_WORK,
    forwarded_allow_ips: tuple[str, ...] = (),
) -> FastAPI:
    """The web app over `engine`: the page at "/" (its API `/generate` for gradio_client, `/gradio_api/...`).

    `images_per_device`: the page's default; `concurrency`: requests the page hands the engine at once
    (default: twice its slots); `queue_size`: requests waiting beyond those, more are refused at once;
    `auth`: (user, password) pairs for the page and its API; `mcp`: also serve `/generate` as an MCP tool;
    `allowed_paths` / `blocked_paths`: files the page may serve or never serve (default: Gradio's
    GRADIO_ALLOWED_PATHS / GRADIO_BLOCKED_PATHS). The page's Blocks is `app.state.demo`, and its `ClientFiles`
    (pictures.py) `app.state.files`.

    Beside the page, on the same port: AUTOMATIC1111's API at /sdapi/v1/ (a1111.py) and OpenAI's Images API at
    /v1/images/ (openai_images.py). `auth` and `api_keys` close them (api_gate.py: HTTP Basic as an `auth`
    user, or Bearer with an API key); `api_keys` alone closes only them, not the page. `max_body_mb`: their
    request bodies are refused (413) beyond it, and so are the page's uploads. `max_picture_pixels`: a picture
    sent in (page, APIs, PNG-info drop) over this many pixels is refused from its header, before it is decoded
    (default: `pictures.default_max_pixels`). A path a client names is opened only when it lies in Gradio's
    upload folder or is a picture this server wrote (pictures.py). Failed logins (the page's form, a wrong API
    credential) are slowed, then refused for a while, per address (`login_throttle`, default: throttle.py's).
    `allowed_hosts`: the Host names it answers to, others get 400 (hosts.py: `allowed_hosts`); None: any.
    `picture_ttl_s`: the pictures the page drew are deleted after this long, and Gradio's copies of them.
    `max_caller_requests` / `max_caller_work`: each caller's requests and images x steps in the engine at once, at
    every door together (callers.py); beyond them 429 at once. `forwarded_allow_ips`: the proxies whose
    X-Forwarded-For names the client (callers.py: `ForwardedFor`); from anyone else it is ignored."""
    app = FastAPI(title="jax-sd", docs_url=None, redoc_url=None)  # as Gradio's own app: no /docs pages (yet)
    max_pixels = max_picture_pixels or default_max_pixels(engine.limits)
    files = ClientFiles(max_pixels, ttl_s=picture_ttl_s)
    callers = CallerLimits(max_caller_requests, max_caller_work)  # each caller's share, page and APIs together
    demo = create_demo(
        engine, images_per_device=images_per_device, concurrency=concurrency, files=files, callers=callers
    )
    demo.queue(max_size=queue_size)
    app.state.demo = demo
    app.state.files = files  # the paths clients may name, and the pictures written here

    # Routers (REST APIs) go here, before the page: the page is mounted at "/", and a mount at "/" answers
    # every path that no route before it took.
    jobs = ApiJobs(callers)  # the APIs' running requests, for A1111's /progress and /interrupt
    app.state.api_jobs = jobs
    app.include_router(a1111_router(engine, jobs, max_pixels=max_pixels))
    app.include_router(openai_router(engine, jobs, max_pixels=max_pixels))
    app.include_router(comfy_router(engine, jobs, max_pixels=max_pixels))
    install_error_handlers(app)
    access = ApiAccess(users=tuple(auth or ()), keys=tuple(api_keys or ()))
    # Failed logins, at the page's form and the APIs' gate alike, counted together.
    throttle = LoginThrottle() if login_throttle is None else login_throttle
    app.add_middleware(ApiGate, access=access, max_body_bytes=int(max_body_mb * 2**20), throttle=throttle)
    app.add_middleware(LoginGuard, throttle=throttle)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=frozenset(allowed_hosts))  # the last added runs first
    app.add_middleware(ForwardedFor, allowed=tuple(forwarded_allow_ips))  # first: every door sees the client

    app = gr.mount_gradio_app(
        app,
        demo,
        path="/",
        theme=THEME,
        show_error=False,  # a refusal is a gr.Error with its own message; any other error's text stays in the log
        auth=auth,
        auth_message=AUTH_MESSAGE,
        mcp_server=mcp,
        allowed_paths=_paths(allowed_paths, "GRADIO_ALLOWED_PATHS"),
        blocked_paths=_paths(blocked_paths, "GRADIO_BLOCKED_PATHS"),
        max_file_size=int(max_body_mb * 2**20),  # the page's uploads, as the APIs' bodies
        pwa=get_space() is not None,  # as Gradio's launch: installable on a Space
        # Rendered in the browser, as locally: Gradio's server-side rendering (GRADIO_SSR_MODE, which a Space may
        # set) puts a Node server in front of the app, and a mounted app has no such front.
        ssr_mode=False,
    )
    # Gradio checks that a file a client names was uploaded (else it would copy any file in the temp folder or the
    # working directory into its cache, and serve it) only once the Blocks "has launched", which launch() says
    # and a mounted app never does.
    demo.has_launched = True
    return app


def serve(app: FastAPI, *, server_name: str = "127.0.0.1", server_port: int = 7860, share: bool = False) -> None:
    """Serves `app` with uvicorn until Ctrl-C or SIGTERM. `share`: also open a temporary public gradio.live
    link to it (Gradio's tunnel; not on a Hugging Face Space, which is public already)."""
    import uvicorn

    if share:
        if get_space() is not None:
            log.warning("--share is not supported on Hugging Face Spaces; the Space's own address serves the page")
        else:
            demo = getattr(app.state, "demo", None)
            if demo is not None:
                demo.share = True  # the page's share template, and robots kept out
            threading.Thread(target=_open_share_link, args=(server_name, server_port), daemon=True).start()
    shown = "127.0.0.1" if server_name in ("0.0.0.0", "") else server_name
    log.info("serving on http://%s:%d/", shown, server_port)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # As Gradio's own close: the pages' heartbeat streams end at once, so the server need not wait for them.
            for route in app.routes:
                stop = getattr(getattr(route, "app", None), "stop_event", None)
                if stop is not None:
                    stop.set()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=server_name,
        port=server_port,
        log_level="warning",  # as Gradio's own server: no line per request
        proxy_headers=False,  # X-Forwarded-For is the app's to read, from --forwarded-allow-ips only (ForwardedFor)
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    try:
        Server(config).run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down and raises it again on the way out
        log.info("stopped")


def _open_share_link(host: str, port: int) -> None:
    from gradio import networking

    try:
        url = networking.setup_tunnel(
            local_host=host,
            local_port=port,
            share_token=secrets.token_urlsafe(32),
            share_server_address=None,
            share_server_tls_certificate=None,
        )
    except Exception as e:  # the page serves on locally
        log.warning("could not create a share link: %s", e)
        return
    log.info("public link (up to a week): %s", url.replace("http://", "https://", 1))
