"""Parameters and optimizer state: each block's weights, where its masters, gradients and
optimizer state live (on the device, or in the host tier replicated or sharded over the
ranks), and the learning-rate schedule over the per-block optimizers (lr.py).
"""
