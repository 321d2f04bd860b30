"""Orchestration: runs stage attempts, decides what runs next, and dispatches (in-process or Celery).

Holds no maths and no file-format code; it calls `pipeline.stages` and records outcomes in `pipeline.db`.
"""
