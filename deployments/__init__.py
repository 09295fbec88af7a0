"""Kiln deployments layer."""
