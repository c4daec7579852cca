"""User-facing errors: raised before work starts, printed as one line by the entry points."""


class LitSpecError(Exception):
    """A problem the user can fix (bad path, bad field, missing hardware). The message says what and how."""


class ConfigError(LitSpecError):
    """A config value that cannot work."""


class DataError(LitSpecError):
    """A dataset that is missing, empty or lacks the columns its template needs."""
