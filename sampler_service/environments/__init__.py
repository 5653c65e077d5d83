"""Environments an episode runs against (placeholder until the package lands)."""
