"""Heads with a fixed-size state: the shared core (core.py) and the pieces their variants share."""
