"""Entry point: ``python -m backend.worker SPEC_JSON RANK_DIR`` (started by the node agent)."""
from .main import entry

if __name__ == "__main__":
    entry()
