"""What a run starts from and loading it: each tier of the restore chooses, ``loader`` loads a checkpoint.

Each module is imported where it is used (docs/architecture.md lists them); the package re-exports nothing.
"""
