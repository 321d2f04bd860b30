"""The real download stage."""

from pipeline.stages.download import *  # noqa: F403 - the stage as it is, every name of its __all__
from pipeline.stages.download import __all__  # noqa: F401
