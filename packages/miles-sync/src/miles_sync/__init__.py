"""Trainer -> engine weight sync: buckets, IPC, broadcast, p2p, disk-delta and the puller."""

from importlib.metadata import version as _version

__version__ = _version("miles-sync")
