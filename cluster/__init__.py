"""jax-sd on a Ray Serve cluster: engine replicas behind the same Gradio page.

    serve run serve_config.yaml        # a local cluster, or the head node of a real one

`EngineReplica` (replica.py) holds one warmed-up engine per accelerator host; `RemoteEngine` (remote.py)
gives the web layer the engine's face over the replicas; `Page` (ingress.py) serves `web.build_app` as the
cluster's ingress, and `build_app` makes the application from a Serve config's args. Ray is needed here
only: `python app.py`, `web` and the engine never import it.
"""

from .ingress import Page, application, build_app
from .remote import RemoteEngine, RemoteTicket
from .replica import Description, EngineReplica
from .settings import ClusterSettings

__all__ = [
    "ClusterSettings",
    "Description",
    "EngineReplica",
    "Page",
    "RemoteEngine",
    "RemoteTicket",
    "application",
    "build_app",
]
