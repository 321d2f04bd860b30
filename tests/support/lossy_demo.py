"""The demo checkpoint's lossy route, for tests of what a lossy conversion runs.

The demo's linear weights are exactly ternary and its embedding and head BF16: by default it converts
bit for bit, calibrate is not needed and validate scores nothing. These options store the embedding
and head as F16 instead, which rounds a few values: calibrate runs the source and validate scores the
file against it, as for any lossy conversion.
"""

LOSSY_OPTIONS = {"embed_type": "F16", "output_type": "F16"}
LOSSY_ARGS = ("--option", "embed_type=f16", "--option", "output_type=f16")
