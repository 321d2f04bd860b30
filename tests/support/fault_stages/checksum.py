"""The real checksum stage."""

from pipeline.stages.checksum import *  # noqa: F403 - the stage as it is, every name of its __all__
from pipeline.stages.checksum import __all__  # noqa: F401
