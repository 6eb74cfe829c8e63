"""The bottom layer: files and processes, shared by every other package."""
