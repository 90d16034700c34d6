"""The checkpoint folder as files: names, metadata, manifest, checksums, durable writes, catalog, retention."""
