"""Readable pytree paths for messages and reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def path_to_str(path: Sequence[Any]) -> str:
    """Formats a pytree key path as ``"mlp/~/linear_0/w"``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)
