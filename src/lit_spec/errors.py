"""User-facing errors: raised before work starts, printed as one line by the entry points."""


class LitSpecError(Exception):
    """A problem the user can fix (bad path, bad field, missing hardware). The message says what and how."""


class ConfigError(LitSpecError):
    """A config value that cannot work."""


class DataError(LitSpecError):
    """A dataset that is missing, empty or lacks the columns its template needs."""


def check_count(name: str, value, minimum: int = 1) -> int:
    """An integer hyperparameter >= ``minimum`` (bools and non-integral floats refused), or a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)
