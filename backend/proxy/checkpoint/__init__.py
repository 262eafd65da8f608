"""The checkpoint format and its I/O, the proxy's lowest layer: the store (rank folders, manifest,
commit), deduplicated tensor pickles, digests, and the fingerprint an exact resume depends on.

Imports nothing else of the proxy; the engine and the distributed layer write and read through it.
"""
