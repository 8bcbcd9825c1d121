"""GNN serving: admission, dynamic batching, overlapped sample/gather/model stages, HTTP API.

``Engine`` is the in-process core; ``create_app`` puts it behind FastAPI; ``Client`` calls the
HTTP API; ``loadgen`` measures it with open-loop Poisson load.
"""

from quiver.serving.batcher import Overloaded, ShuttingDown
from quiver.serving.config import ServeConfig
from quiver.serving.engine import Engine, Result

__all__ = ["Engine", "Overloaded", "Result", "ServeConfig", "ShuttingDown"]
