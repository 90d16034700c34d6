"""The checkpoint folder as files: every name (``layout``), metadata, manifest, checksums, durable writes, catalog.

Each module is imported where it is used; the package re-exports nothing: ``layout`` (file and format names),
``paths`` (the path validator), ``bounded`` (limits on untrusted files), ``metadata``, ``manifest``, ``checksum``,
``durable`` (fsync, atomic pointers), ``catalog`` (listing, pointers, best by monitor), ``retention``,
``quarantine``, ``fingerprint`` (is it this run's) and ``loadcheck`` (checksums computed while a load reads).
"""
