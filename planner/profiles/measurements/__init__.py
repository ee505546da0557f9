"""Measurement files of the shipped profiles (format: planner/measurements.py)."""
