"""Format backends for sharded state: DCP `.distcp` files and per-rank Hugging Face safetensors shards."""
