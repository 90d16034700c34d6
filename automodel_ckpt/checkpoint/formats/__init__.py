"""checkpoint/formats package."""
