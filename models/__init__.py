"""Models: architectures (one file each), tokenizers, chat templates, sampling, and the
high-level :class:`Model` API."""
from __future__ import annotations

from .context import Context, ContextFullError
from .engine import Engine
from .loader import ARCHITECTURES, LoadedModel, UnsupportedArchitecture, load_model
from .model import Model
from .placement import Placement, PlacementError, parse_ngl
from .tokenizer import Tokenizer

__all__ = ["ARCHITECTURES", "Context", "ContextFullError", "Engine", "LoadedModel", "Model", "Placement", "PlacementError",
           "Tokenizer", "UnsupportedArchitecture", "load_model", "parse_ngl"]
