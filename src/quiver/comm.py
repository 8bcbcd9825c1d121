"""torch-quiver's ``quiver.comm``: :class:`~quiver.feature.dist.NcclComm` and
:func:`~quiver.feature.dist.getNcclId` (a gloo group on CPU; see :mod:`quiver.feature.dist`)."""

from quiver.feature.dist import NcclComm, getNcclId

__all__ = ["NcclComm", "getNcclId"]
