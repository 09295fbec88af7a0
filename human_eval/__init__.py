"""Kiln human_eval layer."""
