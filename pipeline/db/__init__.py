"""Persistence: models, engine/session factory and the repository that writes status."""
