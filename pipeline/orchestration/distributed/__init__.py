"""Distributed mode: the Celery app (built from Settings on demand), thin tasks, dispatch and reconcile."""
