"""Kiln models layer."""
