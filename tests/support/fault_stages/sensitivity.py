"""The real sensitivity stage."""

from pipeline.stages.sensitivity import *  # noqa: F403 - the stage as it is, every name of its __all__
from pipeline.stages.sensitivity import __all__  # noqa: F401
