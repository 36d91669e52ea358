"""Data-parallel degrees -> one DeviceMesh (DDP, FSDP or HSDP)."""

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    """Replicate x shard = world size (validated by config_validation.validate_layout); a degree of -1 (one of them)
    takes the rest.

    replicate > 1, shard == 1: DDP; shard > 1: FSDP; both > 1: HSDP on a 2D mesh.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    fsdp_single_device: bool = False  # FSDP2 on a 1-rank mesh: bf16 compute params instead of autocast
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        # The degrees were validated with the world size (config_validation.validate_layout): only resolve -1.
        if self.dp_shard == -1:
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_replicate == -1:
            self.dp_replicate = self.world_size // self.dp_shard

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or (self.fsdp_single_device and self.world_size == 1)

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def mode(self) -> str:
        if self.hsdp_enabled:
            return "hsdp"
        if self.fsdp_enabled:
            return "fsdp"
        return "ddp" if self.ddp_enabled else "single"

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The (dp_replicate, dp_shard) mesh with a flattened 'dp' dim; None for one process."""
        if self.world_size == 1 and not self.fsdp_enabled:
            return None
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        # Kept here: slicing a flattened dim back out of the root mesh is deprecated.
        self._dp_mesh = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._mesh

    def dp_rank(self) -> int:
        if self._mesh is None:
            return 0
        return self._dp_mesh.get_local_rank()

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh fully_shard takes: 1D shard mesh for FSDP, 2D (replicate, shard) for HSDP."""
        if self.hsdp_enabled:
            return self._mesh[("dp_replicate", "dp_shard")]
        return self._mesh["dp_shard"]

    def dp_group(self) -> torch.distributed.ProcessGroup | None:
        return None if self._mesh is None else self._dp_mesh.get_group()
