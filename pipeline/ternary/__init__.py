"""Ternary decomposition: block fits, matrix decomposition, llama.cpp packing and the type policy.

Pure torch/numpy, plus a compiled numba kernel for the CPU: no I/O, no logging side effects.
"""

from __future__ import annotations
