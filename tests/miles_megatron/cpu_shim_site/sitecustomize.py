"""Test support: with this directory and tests/miles_megatron on ``PYTHONPATH``, every Python
process of a ``miles train`` run (the driver, Ray's trainer actors, the engines) installs the
megatron CPU shim (``megatron_shim.py``) right before ``miles_megatron`` is first imported, so
the megatron backend trains on gloo CPU ranks inside the real launcher. Processes that never
import ``miles_megatron`` are left as they are. Not used in production (see
:func:`megatron_cli_env`)."""

import importlib.abc
import sys


class _InstallShimFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "miles_megatron":
            sys.meta_path.remove(self)
            import megatron_shim

            megatron_shim.install()
        return None  # the normal finders import the module


sys.meta_path.insert(0, _InstallShimFirst())
