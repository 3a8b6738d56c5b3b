"""The FSDP device mesh: ``(dp_replicate, dp_shard)``.

FSDP is pure data parallel. ``dp_shard = world_size / dp_replicate`` ranks shard parameters,
gradients and optimizer state among themselves; ``dp_replicate`` such groups hold replicas
(HSDP). With ``dp_replicate == 1`` the mesh is one flat ``dp_shard`` dimension. Every rank of the
mesh consumes its own data shard: the data-parallel size is the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the two FSDP mesh dimensions."""

    dp_replicate: int
    dp_shard: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard


def mesh_shape(world_size: int, dp_replicate: int) -> MeshShape:
    """Split ``world_size`` into ``(dp_replicate, dp_shard)``; raise ``ValueError`` if it does not divide."""
    if dp_replicate < 1:
        raise ValueError(f"--dp-replicate-size must be >= 1, got {dp_replicate}")
    if world_size % dp_replicate:
        raise ValueError(
            f"--dp-replicate-size {dp_replicate} does not divide the world size {world_size}"
        )
    return MeshShape(dp_replicate=dp_replicate, dp_shard=world_size // dp_replicate)


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """Build the mesh over all ranks of the default process group.

    A 1-D ``("dp_shard",)`` mesh when ``dp_replicate == 1`` (plain FSDP), otherwise the 2-D
    ``("dp_replicate", "dp_shard")`` mesh that ``fully_shard`` treats as hybrid sharding.
    """
    if shape.dp_replicate == 1:
        return init_device_mesh(device_type, (shape.dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device_type,
        (shape.dp_replicate, shape.dp_shard),
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )
