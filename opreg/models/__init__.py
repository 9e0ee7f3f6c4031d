"""Copies of the reference models in ../shared/reference_models (used by `python -m opreg demo`)."""
