"""Every error the engine raises on purpose, in one place: each message says what to change."""


class ConfigError(ValueError):
    """A config.json that this engine cannot read or does not support."""


class SourceError(ValueError):
    """A model source that cannot be found, fetched or read."""


class WeightsError(ValueError):
    """A checkpoint that does not fit the model built from its config."""


class InvalidRequest(ValueError):
    """Bad user input; the message says what to change."""


class Busy(RuntimeError):
    """The engine's waiting room is full; the message says to try again shortly."""


class Cancelled(RuntimeError):
    """The request was stopped (Stop button, closed tab, or `Ticket.cancel`)."""


class GenerationFailed(RuntimeError):
    """The engine could not draw a request's pictures; the message says why."""
