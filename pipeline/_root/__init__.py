"""redumix: learn from your own reflections (harvest, train, eval)."""
