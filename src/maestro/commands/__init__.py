"""Sub-commands of the ``maestro`` CLI, one module each."""
