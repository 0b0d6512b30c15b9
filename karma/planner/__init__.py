"""The planner: decides per block what to keep, swap or recompute, from plain numbers only."""
