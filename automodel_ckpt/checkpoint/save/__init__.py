"""Writing a checkpoint: ``writer.SaveWriter`` runs one save at a time, written now or in the background.

Each module is imported where it is used (docs/architecture.md lists them); the package re-exports nothing.
"""
