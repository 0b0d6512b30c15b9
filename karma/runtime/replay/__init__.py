"""Replay: the schedule's operations run around the model's own forward and backward, one
micro-batch a replay.

The engine follows the model's own forward and backward through hooks and, at each point
the schedule names, issues the copies, exchanges and host steps of the stages reached to
their streams and waits for what the next compute operation needs. Here: the engine
(engine.py), the tables it reads the schedule through (tables.py), the hooks (hooks.py), the
streams and their events (streams.py), swapped activations (swap.py), the update side of a
step (update.py), evaluation (evaluation.py), tracing (tracing.py), the training options
(training_options.py) and chaos timing for tests (chaos.py).
"""
