"""The real inspect stage."""

from pipeline.stages.inspect import *  # noqa: F403 - the stage as it is, every name of its __all__
from pipeline.stages.inspect import __all__  # noqa: F401
