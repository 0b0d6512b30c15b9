"""The block-graph IR: a model file traced on the meta device and grouped into blocks.

    from karma.ir.build import build_block_graph
    graph = build_block_graph(load_model_file("examples/gpt.py"), batch_size=8)
    print(graph.table())

graph.py holds the plain, torch-free values the planner reads (BlockGraph, Block, Edge,
OptimizerProfile); trace.py, blocks.py, compute.py and measure.py trace a model and measure
its blocks on the meta device (build.py puts them together); timing.py times blocks on a
real device, and optimizer.py measures the model file's optimizer.
"""
