"""distributed package."""
