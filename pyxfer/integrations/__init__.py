"""Integrations of pyxfer with other libraries: opt-in, reversible, and lazy.

Importing pyxfer (or this package) imports none of the target libraries; each integration module
imports its target on first use and raises IntegrationError (an ImportError) when the library is
missing or outside the tested version range.

- ``pyxfer.integrations.accelerate``: ``attach(model)`` / ``detach(model)`` put verified moves and a
  device guard on a model dispatched by Hugging Face accelerate; ``patch_send_to_device()`` is the
  opt-in, process-wide patch of ``accelerate.hooks.send_to_device``.
- ``pyxfer.integrations.transformer_engine``: patched all-gather fallbacks of Transformer Engine.

Every patch follows one contract (``pyxfer.integrations._patch``): ``patch(**options)`` returns a
PatchReport of every binding it replaced and is idempotent, ``unpatch()`` puts back the identical
original objects, ``patched(**options)`` is the context manager, ``is_patched()`` tells.
"""
from ._patch import Binding, Integration, IntegrationError, PatchConflictError, PatchReport

__all__ = ["Binding", "Integration", "IntegrationError", "PatchConflictError", "PatchReport"]
