"""Apply FSDP2 (``fully_shard``) to a HF causal LM.

Units, innermost first: the modules a per-module precision policy names
(``PrecisionConfig.module_compute_dtypes``, each in its own dtype), every module whose class is
named in ``model._no_split_modules`` (the decoder layers), the input embedding and the output head when they are untied, then the root
(which collects everything left: final norm, tied head, rotary buffers). Each unit all-gathers
its parameters in ``compute_dtype`` before use and reduce-scatters gradients in fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from miles_fsdp.precision import PrecisionConfig


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose class is listed in ``model._no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules: cannot find its decoder layers"
        )
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no submodule of class {sorted(names)} (_no_split_modules)"
        )
    return layers


def embeddings_tied(model: nn.Module) -> bool:
    """Whether the input embedding and the output head share one weight."""
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: PrecisionConfig,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard`` and return it.

    ``cpu_offload`` keeps sharded parameters, gradients and optimizer state in host memory
    (FSDP2 ``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
    """
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    own = precision.module_compute_dtypes
    if own:
        modules = [m for m in model.modules() if type(m).__name__ in own]
        if not modules:
            raise ValueError(
                f"precision policy names {sorted(own)}, but {type(model).__name__} has no "
                "module of those classes"
            )
        for module in modules:
            policy = precision.mixed_precision_policy(own[type(module).__name__])
            fully_shard(module, mp_policy=policy, **kwargs)
    kwargs["mp_policy"] = precision.mixed_precision_policy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    if not embeddings_tied(model):
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            if module is not None:
                fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model
