"""jax-sd on a Ray Serve cluster: engine replicas behind the same Gradio page.

    serve run serve_config.yaml        # a local cluster, or the head node of a real one

`EngineReplica` (replica.py) holds one warmed-up engine per accelerator host; `RemoteEngine` (remote.py)
gives the page the engine's face over the replicas; `Page` and `build_app` (ingress.py) serve the page
as the cluster's ingress. Ray is needed here only: `python app.py` and the engine never import it.
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
