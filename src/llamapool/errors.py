"""Errors shared by the daemon's parts and the SDK's key handling, with nothing of the daemon behind them."""


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key."""
