"""Router: the ZeroMQ broker between clients and workers."""

from llamapool.router.broker import Router, RouterConfig

__all__ = ["Router", "RouterConfig"]
