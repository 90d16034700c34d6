"""Process groups, device meshes and FSDP2 sharding."""
