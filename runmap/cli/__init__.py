"""The ``runmap`` command line: ``main`` dispatches to one module per subcommand (``runmap.cli.<name>``)."""
from runmap.cli.main import main

__all__ = ["main"]
