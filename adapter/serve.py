"""`serve`: the container entry point (SageMaker runs `IMAGE serve`) and the local dev server.

Settings are validated before anything else, so a bad variable stops the process with one
line naming it; a model that fails to load stops it with exit code 1 after /ping has
reported the failure.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from adapter.app import create_app
from adapter.settings import SettingsError, load_settings

KEEP_ALIVE_SECONDS = 75  # longer than SageMaker's 60 s idle connection reuse


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


def main(argv: list[str] | None = None) -> None:
    """Run the server; `serve` with no arguments, as SageMaker calls it."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["serve"]):
        sys.exit(f"usage: serve  (settings come from SEMIF_* environment variables; got {args})")
    configure_logging()
    try:
        settings = load_settings()
    except SettingsError as error:
        sys.exit(f"serve: {error}")
    failures: list[str] = []
    server: uvicorn.Server | None = None

    def stop_on_load_failure(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_failure=stop_on_load_failure)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http="h11",
        lifespan="on",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        log_config=None,
    )
    server = uvicorn.Server(config)
    server.run()
    if failures:
        sys.exit(f"serve: model load failed: {failures[0]}")


if __name__ == "__main__":
    main()
