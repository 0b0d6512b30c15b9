"""The runtime: replays a schedule to train the model it was planned for.

It imports the schedule and the model-file protocol, never the planner or the IR.
"""
