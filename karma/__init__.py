"""karma: train PyTorch models whose memory needs exceed the GPU's.

An ahead-of-time planning compiler plus a runtime:

    model.py -> karma.ir (BlockGraph) -> karma.planner (Plan) -> schedule YAML -> karma.runtime
"""

__version__ = "0.1.0"
