"""The checkpoint folder as files: every name (layout), metadata, manifest, checksums, durable writes and pointers, catalog, retention, fingerprint."""
