"""Celery side of the distributed mode: the app, thin stage tasks, and dispatch."""
