"""megatron-core training backend: TP/PP/CP/EP/ETP and torch_dist checkpoints."""

from importlib.metadata import version as _version

__version__ = _version("miles-megatron")

import warnings as _warnings

# megatron-core warns at import, once per module, that TransformerEngine and Apex are absent and
# that it falls back to its own implementations. This backend builds megatron-core's local spec
# (--transformer-impl local) and its optimizers: that is the configuration, not news for every
# run's console (an option that needs TransformerEngine is refused by name).
_warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
