"""Errors the store raises (LeaseTimeout is with Lease, in lease.py)."""
from __future__ import annotations


class CorruptArtifactError(RuntimeError):
    """A file of a published artifact is missing or does not match its manifest digest."""


class StoreUnavailableError(ConnectionError):
    """The store's server could not be reached (after the client's retries and timeouts)."""

