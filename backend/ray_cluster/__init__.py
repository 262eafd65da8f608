"""Node agents on a Ray cluster (``singularityctl serve --ray ADDRESS``).

One agent per alive Ray node with GPUs, as a Ray actor pinned to that node that holds all of
its GPUs, so Ray hands them to nothing else. Ray is an optional extra
(``pip install "singularity-notebooks[ray]"``): nothing outside this package imports it, and
this package imports it only inside the functions that need it.

- ``nodes.py``: which Ray nodes get an agent, their names and addresses (pure, no Ray);
- ``actor.py``: the actor that runs one node's agent process;
- ``placer.py``: the driver side: joins the cluster, places and forgets actors;
- ``loop.py``: the server's task that keeps one agent on every GPU node as nodes come and go.
"""
