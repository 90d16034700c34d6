"""Where a run folder lives: a local folder or an object-store run folder, behind one interface chosen once."""
