"""The node-local checkpoint tier's parts: placement of copies, file transfer between ranks, inventory, folders."""
