"""Every byte format a checkpoint holds: sharded model and optimizer state, PEFT adapters, safetensors, pickles.

Each module is imported where it is used; the package re-exports nothing; docs/architecture.md lists them."""
