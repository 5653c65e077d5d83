"""Reward verifiers, named by spec strings: `exact`, `math` or `python:module:function`.

A spec (not a function object) is what travels to a verifier worker process, which
resolves it itself; built-in names are aliases for import paths, so `math` only imports
math-verify where it is used.
"""

from __future__ import annotations

import functools

from sampler_service.verifiers import python
from sampler_service.verifiers.base import Verdict, VerifierFn

BUILTIN = {
    "exact": "sampler_service.verifiers.exact:verify",
    "math": "sampler_service.verifiers.math:verify",
}

__all__ = ["BUILTIN", "Verdict", "VerifierFn", "resolve"]


@functools.cache
def resolve(spec: str) -> VerifierFn:
    """The verifier function a spec names; ValueError/ImportError if there is none."""
    if spec in BUILTIN:
        return python.load(BUILTIN[spec])
    kind, sep, target = spec.partition(":")
    if kind == "python" and sep:
        return python.load(target)
    raise ValueError(
        f"unknown verifier {spec!r}: use {' | '.join(BUILTIN)} | python:module:function"
    )
