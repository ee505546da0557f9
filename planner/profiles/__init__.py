"""Data shipped with the planner: calibrated profiles (``*.yaml``) and the measurement
files they were fitted on (``measurements/*.json``); docs/planner.md states their sources."""
