"""The real stages, with a decompose and a package that misbehave on purpose (BONSAI_STAGE_PACKAGE
for fault tests).

``BONSAI_TEST_PACKAGE_FAULT``: ``delay:S`` (sleep S seconds before the real package).
``BONSAI_TEST_DECOMPOSE_FAULT``: ``delay:S`` (sleep S seconds first, so a test can act while
it runs), ``hog`` (grow memory until something stops it), ``sigkill`` (the process kills itself,
as the kernel's out-of-memory killer would). Unset: the real decompose.
"""
