"""nanoflow's version: one fact, read by the package top and by the checkpoint metadata io writes."""

__version__ = "0.1.0"
