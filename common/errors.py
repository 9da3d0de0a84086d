"""User-facing errors: the launcher prints them as one line (`kiln: error: ...`), no traceback."""


class UserError(Exception):
    """A problem the user can fix: a config value, a parallel layout, a file, a data shard."""


class ConfigError(UserError, ValueError):
    """A bad key, value or combination in the configuration."""


class DataError(UserError):
    """Unusable input data: too few shards for the layout, too many corrupt shards, a loader
    position that does not fit the data it is resumed on."""


class WeightSyncError(UserError):
    """The rollout engine did not take the trainer's weights (its log-probs of the probe differ from the trainer's
    after a sync). Not a user's mistake, but it stops the run with one line as one does: the run must not go on
    learning from samples of weights it is not training."""
