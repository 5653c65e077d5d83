"""`python:module:function`: a user verifier imported by name.

Verifiers are named by import path rather than passed as objects so that pool workers
can import them in their own process (nothing needs to pickle but the string).
"""

from __future__ import annotations

import importlib

from sampler_service.verifiers.base import VerifierFn


def load(target: str) -> VerifierFn:
    """Import `module:function` (the module must be importable in the server's sys.path)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {target!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{target!r} is not a callable in module {module_name!r}")
    return fn
