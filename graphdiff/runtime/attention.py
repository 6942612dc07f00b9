"""A transformers attention function registered only while a model uses it.

transformers looks a model's attention implementation up by name in one process-wide registry
(`AttentionInterface`, at every forward); it has no way to unregister. `use_attention` registers a function,
points the model's config at it and returns the undo, which puts the config back and, once no model uses the
name any more, puts back what the registry held under it (nothing, usually).

transformers builds a layer's attention mask with the function its mask registry (`AttentionMaskInterface`) holds
under the same name, and for a name it does not hold it passes no mask at all: no padding, no sliding window. So
the name gets sdpa's mask function too (a boolean mask; none where plain causal attention is all it says).

transformers is imported only when a function is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ABSENT = object()
_USERS: dict[str, tuple[Any, Any, int]] = {}  # name -> (what each registry held under it before, models using it)


def _put_back(registry: Any, name: str, previous: Any) -> None:
    """The registry's entry for `name` as it was (removed where it held none)."""
    if previous is _ABSENT:
        registry._global_mapping.pop(name, None)  # what `register` writes; there is no unregister
    else:
        registry.register(name, previous)


def register_attention(name: str, fn: Callable) -> Callable[[], None]:
    """Register `fn` under `name` with transformers' AttentionInterface (and sdpa's mask function with its
    AttentionMaskInterface); returns the undo (idempotent). The last user's undo puts back what the name held
    before (or removes it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    attention, masks = AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping
    before = (attention.get(name, _ABSENT), masks.get(name, _ABSENT), 0)
    previous, previous_mask, users = _USERS.get(name, before)
    _USERS[name] = (previous, previous_mask, users + 1)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    done = False

    def undo() -> None:
        nonlocal done
        if done:
            return
        done = True
        previous, previous_mask, users = _USERS.pop(name)
        if users > 1:
            _USERS[name] = (previous, previous_mask, users - 1)
            return
        _put_back(AttentionInterface, name, previous)
        _put_back(AttentionMaskInterface, name, previous_mask)

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
