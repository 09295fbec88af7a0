"""Kiln data_quality layer."""
