"""User-facing errors: the launcher prints them as one line (`kiln: error: ...`), no traceback."""


class UserError(Exception):
    """A problem the user can fix: a config value, a parallel layout, a file, a data shard."""


class ConfigError(UserError, ValueError):
    """A bad key, value or combination in the configuration."""


class DataError(UserError):
    """Unusable input data: too few shards for the layout, too many corrupt shards, a loader
    position that does not fit the data it is resumed on."""
