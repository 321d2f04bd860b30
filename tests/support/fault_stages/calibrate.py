"""The real calibrate stage."""

from pipeline.stages.calibrate import *  # noqa: F403 - the stage as it is, every name of its __all__
from pipeline.stages.calibrate import __all__  # noqa: F401
