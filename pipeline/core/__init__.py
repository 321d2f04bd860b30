"""The bottom layer: errors, states and settings. Imports nothing else of the pipeline."""
