"""Drop-ins for model libraries (optional dependencies, imported on use)."""
