"""Every byte format a checkpoint holds: sharded model and optimizer state, PEFT adapters, safetensors, pickles.

Each module is imported where it is used; the package re-exports nothing. The model formats are plug-ins, one
module each, registered by one line of ``registry``. docs/architecture.md lists the modules.
"""
