"""Name prefixes the trainer's model and the released checkpoint spell differently.

transformers renames some checkpoints' trunk at load time (Nemotron-H's ``backbone.*``, the
multimodal Qwen3.5 checkpoints' ``model.language_model.*``, both loaded as ``model.*``); weights
go back out under the checkpoint's names through :func:`prefix_rename`.
"""

from __future__ import annotations

from miles_fsdp.adaptations.registry import ParamTransform


def prefix_rename(model_prefix: str, checkpoint_prefix: str) -> ParamTransform:
    """Param transform: ``model_prefix + rest`` -> ``checkpoint_prefix + rest`` (other names
    left alone)."""

    def rename(name, tensor, config):
        if name.startswith(model_prefix):
            return [(checkpoint_prefix + name[len(model_prefix) :], tensor)]
        return None

    rename.__name__ = f"rename_{model_prefix.strip('.')}_to_{checkpoint_prefix.strip('.')}"
    return rename
