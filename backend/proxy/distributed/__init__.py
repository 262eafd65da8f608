"""The distributed layer: ranks of one job under the engine. Collectives are intercepted (a
process group of the proxy's own), the ranks agree on a consistent cut before a checkpoint, and a
job resized to fewer devices splices several ranks' work into one process, exactly.

Imports the engine and the checkpoint layer; the launchers (`backend.proxy.launch`, ``python -m
backend.proxy``) and the worker sit above it.
"""
