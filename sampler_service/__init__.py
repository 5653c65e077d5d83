"""adaptive-rollout: the sampler service."""

from __future__ import annotations


def package_version() -> str:
    """The installed distribution's version (a source checkout that is not installed: 0+unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("adaptive-rollout")
    except PackageNotFoundError:
        return "0+unknown"
