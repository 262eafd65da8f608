"""What ``@hydra.main`` set up before it called ``main(cfg)``, carried by a checkpoint.

A restore re-enters ``main`` through hydra's wrapper with a config passed through
(`library_wrappers`), so hydra's setup does not run again: no second parse of the command line,
no new output folder named by the time of the restore, no second set of log handlers. What that
setup left in the process, and the program may read after the restore, comes back from here:
hydra's singletons (``HydraConfig.get()``: the output folder, the job's name and overrides; the
config store; the global ``Hydra`` of the compose API) and hydra's resolvers (``${hydra:...}``,
``${now:...}``), which it registers at each run. The log handlers it configured and the folder it
changed to are carried as any job's are (process_settings.py, context.py).
"""
from __future__ import annotations

import sys
from typing import Any, Optional


def capture() -> Optional[dict[type, Any]]:
    """hydra's singletons by class, without the plugin registry (found again by `apply`, as
    hydra's own remote launchers do); None where the program never imported hydra."""
    singleton = sys.modules.get("hydra.core.singleton")
    if singleton is None:
        return None
    from hydra.core.plugins import Plugins

    instances = {cls: obj for cls, obj in singleton.Singleton._instances.items() if cls is not Plugins}
    return instances or None


def apply(saved: Optional[dict[type, Any]]) -> None:
    if not saved:
        return
    from hydra.core.plugins import Plugins
    from hydra.core.singleton import Singleton
    from hydra.core.utils import setup_globals

    Singleton._instances.update(saved)
    Plugins.instance()
    setup_globals()
