"""`python -m serve_app`: start (or join) Ray, deploy the app, serve OpenAI's API until interrupted.

Without --checkpoint (and DSV41_CHECKPOINT) it serves the embedded default: a tiny random-weight V4.1
checkpoint with a tiny vision tower (preset tiny-vision) generated under checkpoints/tiny-vision (seed 0) with
the real tokenizer, on the CPU: it answers images too.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from pathlib import Path

from serve_app.settings import ServeSettings, SettingsError

LOCAL_MIN_CPUS = 4
TINY_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-vision"


def ensure_tiny_checkpoint(path: Path = TINY_CHECKPOINT) -> Path:
    if not (path / "config.json").exists():
        from engine.presets import tiny_vision_config
        from engine.tools.make_checkpoint import make_checkpoint

        print(f"generating the tiny-vision random-weight checkpoint in {path}", file=sys.stderr)
        make_checkpoint(path, tiny_vision_config(), seed=0)
    return path


def check_speculative_settings(settings: ServeSettings) -> None:
    """With --speculative-tokens K > 0: refuse a K past the checkpoint's DSpark block before Ray starts, rather than
    in every replica's constructor (engine/core/engine_config.check_speculative)."""
    if settings.speculative_tokens == 0:
        return
    from engine.config import load_config
    from engine.core.engine_config import check_speculative

    check_speculative(settings.to_engine_config(), load_config(settings.checkpoint))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--checkpoint" not in argv and not os.environ.get("DSV41_CHECKPOINT"):
        argv += ["--checkpoint", str(ensure_tiny_checkpoint())]
    try:
        settings = ServeSettings.from_cli(argv)
        check_speculative_settings(settings)
    except (SettingsError, ValueError, OSError) as e:  # OSError: no config.json to check K against
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from serve_app.app import APP_NAME, build_app

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:  # a local Ray: enough logical CPUs for the replicas, their shard actors and the ingress on small machines
        needed = math.ceil(settings.num_replicas * (settings.replica_num_cpus + settings.num_shards) + 0.5)
        ray.init(num_cpus=max(LOCAL_MIN_CPUS, needed, os.cpu_count() or 1))
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
    print(f"serving {settings.model_name} from {settings.checkpoint} on http://{settings.host}:{settings.port} "
          "(Ctrl-C stops)", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
