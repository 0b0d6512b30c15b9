"""The runtime: replays a schedule to train the model it was planned for.

It imports the schedule and the model-file protocol, never the planner or the IR. Split by
role; each sub-package imports only those listed before it:

- distributed/: the ranks, the gradient exchange, how sharded state is cut;
- backends/: where compute runs and how streams order work (CPU, CUDA);
- host/: host memory: the host tier, its check, the node's copy, the meters;
- params/: each block's weights and optimizer state, and where they live;
- replay/: the engine and what it drives through one replay;
- checkpoints/: the training state saved, loaded and exported.

At the top: `Runtime` (runtime.py), bringing a run up and down (bringup.py), karma-run's
loop (loop.py) and a step's figures (stats.py).
"""
