"""``python -m backend COMMAND``: the service's commands (backend/commands.py) and singularityctl's."""
import sys

from backend.commands import main

sys.exit(main())
