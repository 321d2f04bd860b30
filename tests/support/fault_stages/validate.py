"""The real validate stage."""

from pipeline.stages.validate import *  # noqa: F403 - the stage as it is, every name of its __all__
from pipeline.stages.validate import __all__  # noqa: F401
