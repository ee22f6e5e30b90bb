"""Many devices: sharding tables, expert parallelism, multi-process runs, deployment plans, deviceless compiles."""
