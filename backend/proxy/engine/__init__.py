"""The single-process engine: the rewrite that makes every loop of user code a safe point, the
runtime the rewritten code calls, the controller another thread asks for checkpoints, and the
state a checkpoint holds (namespace, frames, iterators, RNGs, training objects).

Imports only `backend.proxy.checkpoint`; `ports` declares what its parts see of each other.
"""
