"""The Serve application: the OpenAI ingress bound to the engine deployment.

`build_app(settings)` for Python callers; `app_builder(args)` for `serve deploy` / KubeRay configs
(`import_path: serve_app.app:app_builder`, `args` = ServeSettings fields as strings or values).
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from serve_app import engine_replica
from serve_app.ingress import OpenAIIngress
from serve_app.settings import ServeSettings

APP_NAME = "dsv41"


def build_app(settings: ServeSettings) -> Application:
    engine = engine_replica.deployment(settings).bind(settings)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        num_replicas=1,
        max_ongoing_requests=settings.max_ongoing_requests * settings.num_replicas + 16,
        ray_actor_options={"num_cpus": 0.5},
    )
    return ingress.bind(engine, settings)


def app_builder(args: dict) -> Application:
    return build_app(ServeSettings.from_mapping(args))
