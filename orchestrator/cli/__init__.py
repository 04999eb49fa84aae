"""The ``openlab`` command line: one module per command group, mounted in :mod:`.main`."""
