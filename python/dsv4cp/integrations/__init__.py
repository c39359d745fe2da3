"""Integrations of dsv4cp with serving frameworks (each imports its framework lazily)."""
