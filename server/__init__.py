"""pyggml-server: an OpenAI-compatible HTTP API over a batching Engine (see app.py).

OpenAI's objects (openai.py) are importable without the server's dependencies."""
from __future__ import annotations

__all__ = ["State", "create_app"]


def __getattr__(name: str):
    if name in __all__:  # (Starlette and uvicorn: the server extra)
        from . import app
        return getattr(app, name)
    raise AttributeError(f"module 'pyggml.server' has no attribute {name!r}")
