"""Writing a checkpoint: ``writer.SaveWriter`` runs one save at a time, written now or in the background.

Each module is imported where it is used; the package re-exports nothing: ``writer`` (with each rank's small
files), ``policy`` (export now? the new best? the model folder's helper files, the
inline export), ``overlap`` (the background half of an async save), ``diskfull`` (a save that ran
out of room, settled on every rank) and ``phases`` (where a save spent its time).
"""
