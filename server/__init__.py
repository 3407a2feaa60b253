"""pyggml-server: an OpenAI-compatible HTTP API over a batching Engine (see app.py)."""
from __future__ import annotations

from .app import State, create_app

__all__ = ["State", "create_app"]
