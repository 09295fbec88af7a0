"""Kiln flows layer."""
