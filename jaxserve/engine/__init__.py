"""jaxserve.engine"""

from jaxserve.engine.types import EngineBroken

__all__ = ["EngineBroken"]
