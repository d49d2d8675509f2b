"""Executes a planner Plan: pipeline stages × data-parallel replicas (torch.distributed)."""
