"""Datasets and exact ground truth."""
