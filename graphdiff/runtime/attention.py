"""A transformers attention function registered only while a model uses it.

transformers looks a model's attention implementation up by name in one process-wide registry
(`AttentionInterface`, at every forward); it has no way to unregister. `use_attention` registers a function,
points the model's config at it and returns the undo, which puts the config back and, once no model uses the
name any more, puts back what the registry held under it (nothing, usually).

transformers is imported only when a function is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ABSENT = object()
_USERS: dict[str, tuple[Any, int]] = {}  # name -> (what the registry held under it before, models using it)


def register_attention(name: str, fn: Callable) -> Callable[[], None]:
    """Register `fn` under `name` with transformers' AttentionInterface; returns the undo (idempotent). The last
    user's undo puts back what the name held before (or removes it)."""
    from transformers import AttentionInterface

    registry = AttentionInterface._global_mapping  # what AttentionInterface.register writes; there is no unregister
    previous, users = _USERS.get(name, (registry.get(name, _ABSENT), 0))
    _USERS[name] = (previous, users + 1)
    AttentionInterface.register(name, fn)
    done = False

    def undo() -> None:
        nonlocal done
        if done:
            return
        done = True
        previous, users = _USERS.pop(name)
        if users > 1:
            _USERS[name] = (previous, users - 1)
        elif previous is _ABSENT:
            registry.pop(name, None)
        else:
            AttentionInterface.register(name, previous)

    return undo


def use_attention(model: Any, name: str, fn: Callable) -> Callable[[], None]:
    """Register `fn` as `name` and make the model's attention layers call it (they look the implementation up in
    the shared config at every forward); returns the undo (the config's implementation and the registry back)."""
    unregister = register_attention(name, fn)
    previous = model.config._attn_implementation
    model.config._attn_implementation = name

    def undo() -> None:
        model.config._attn_implementation = previous
        unregister()

    return undo
