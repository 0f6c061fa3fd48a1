"""The cluster's front door: the web app of `python app.py`, served by a Ray Serve ingress over the replicas.

The app is `web.build_app` over a `RemoteEngine`: a FastAPI app with the Gradio page mounted by Gradio's own
`gr.mount_gradio_app` (which starts Gradio's queue with the app's lifespan; Serve's `GradioIngress`
builds the app without that, so its queue would wait for a browser to start it). The same `/generate`
API answers `gradio_client`. One page replica: Gradio's queue and its files live in that process, so a
user's events and pictures must come from the replica that took the request.

    serve run serve_config.yaml                    # the application `build_app` makes from its args
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from .remote import RemoteEngine
from .replica import EngineReplica
from .settings import ClusterSettings


@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,  # every open page and stream is a request here; the replicas bound the work
)
@serve.ingress()
class Page:
    async def __init__(self, engines: DeploymentHandle, settings: ClusterSettings | None = None):
        self.settings = settings or ClusterSettings()
        # Waits for the first replica to be warm: the page starts with the model's real defaults and limits.
        description = await engines.describe.remote()
        self.engine = RemoteEngine(engines, description, model=self.settings.model, retries=self.settings.retries)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return page_app(self.engine, self.settings)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def page_app(engine, settings: ClusterSettings) -> FastAPI:
    """The page's app over `engine`: `python app.py`'s, with the settings' queue and doors."""
    import web  # the web layer (web/ at the repository root); imported here, where it is served

    return web.build_app(engine, **settings.web_options())


def application(
    settings: ClusterSettings | None = None, replica: serve.Deployment = EngineReplica, page: serve.Deployment = Page
) -> Application:
    """The page bound to the replicas. `replica` / `page`: the deployments with other options (`.options(...)`)."""
    settings = settings or ClusterSettings()
    return page.bind(replica.bind(settings), settings)


def build_app(args: dict) -> Application:
    """`import_path: cluster:build_app` in a Serve config; its `args` are the `ClusterSettings`."""
    return application(ClusterSettings.from_args(args))
