"""Errors of weight sync."""

from __future__ import annotations


class PublishError(RuntimeError):
    """A publish did not complete. The engines stay on (or, if they died, come back at) their
    previous weight version; the trainer's state is untouched and the publish can be retried.
    The message names the version, the engine and the engine's own words."""


class DeltaError(RuntimeError):
    """A disk-delta version is missing, truncated or corrupt (the message names the file)."""
