"""Kiln tasks layer."""
