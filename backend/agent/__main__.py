"""Entry point: ``python -m backend.agent`` (also ``singularityctl agent``)."""
from .agent import main

if __name__ == "__main__":
    main()
