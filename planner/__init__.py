"""Deployment planner over heterogeneous GPUs (never imports torch)."""
