"""Load what a job sends back (results, outputs) without rewriting the caller's own classes.

cloudpickle sends classes of the submitter's own modules and notebook cells by value. When a
result holding an instance of such a class comes back, cloudpickle maps it to the caller's class
(the same tracker id, so ``isinstance`` holds) and then sets every attribute of that class again
from the job's copy. Its methods become functions whose code says ``<dynamic-code>``:
``inspect.getsource`` fails on them, tracebacks in the caller lose their lines, and the next
``client.submit(obj.method)`` runs without safe points, since the worker gets no source to
rewrite. Loading through ``loads`` keeps the classes the caller already has as they are; a class
new to the caller is built as cloudpickle builds it.
"""
from __future__ import annotations

import threading
from typing import Any

__all__ = ["loads"]

_LOCK = threading.Lock()


def loads(data: bytes) -> Any:
    """``cloudpickle.loads(data)``, leaving the caller's existing by-value classes untouched."""
    import cloudpickle
    from cloudpickle import cloudpickle as impl

    tracker = getattr(impl, "_DYNAMIC_CLASS_TRACKER_BY_ID", None)
    setstate = getattr(impl, "_class_setstate", None)
    if not hasattr(tracker, "values") or setstate is None:  # a cloudpickle built otherwise
        return cloudpickle.loads(data)
    with _LOCK:
        known = {id(cls) for cls in list(tracker.values())}

        def keep_known(obj: Any, state: Any) -> Any:
            return obj if id(obj) in known else setstate(obj, state)

        # the stream names the state setter by module and name, looked up as it loads
        impl._class_setstate = keep_known
        try:
            return cloudpickle.loads(data)
        finally:
            impl._class_setstate = setstate
