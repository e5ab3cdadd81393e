"""The Serve application: the OpenAI ingress bound to the engine deployment (and, with KV sharing on, to
the KVRouter deployment).

`build_app(settings)` for Python callers; `app_builder(args)` for `serve deploy` / KubeRay configs
(`import_path: serve_app.app:app_builder`, `args` = ServeSettings fields as strings or values).
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from serve_app import engine_replica
from serve_app import router as kv_router
from serve_app.ingress import OpenAIIngress
from serve_app.settings import ServeSettings

APP_NAME = "dsv41"


def build_app(settings: ServeSettings) -> Application:
    """The ingress bound to the engine deployment, and with KV sharing on to the KVRouter deployment too
    (the engine replicas get its handle to report measured pull and prefill speeds)."""
    router = kv_router.deployment(settings).bind(settings) if settings.kv_sharing else None
    engine = engine_replica.deployment(settings).bind(settings, router)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        num_replicas=1,
        max_ongoing_requests=settings.max_ongoing_requests * settings.num_replicas + 16,
        ray_actor_options={"num_cpus": 0.5},
    )
    return ingress.bind(engine, settings, router)


def app_builder(args: dict) -> Application:
    return build_app(ServeSettings.from_mapping(args))
