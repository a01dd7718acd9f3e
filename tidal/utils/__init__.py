"""Small helpers shared across packages (no torch)."""
