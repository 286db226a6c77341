"""``jaxinfer serve``: an OpenAI-compatible HTTP server on the engine (FastAPI on uvicorn).

``app`` holds the routes, ``engine_loop`` the thread that owns the engine, ``metrics`` the
Prometheus metrics. Needs the ``serve`` extra: ``pip install 'jaxinfer[serve]'``.
"""

from jaxinfer.server.app import ServerConfig, build_app, serve

__all__ = ["ServerConfig", "build_app", "serve"]
