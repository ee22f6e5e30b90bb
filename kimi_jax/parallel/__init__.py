"""Many devices: the sharding tables (logical axes -> mesh axes, partition specs), meshes, multi-process runs."""
