"""Sub-commands of the ``quiver`` CLI, one module each."""
