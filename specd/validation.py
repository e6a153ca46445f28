"""The one way specd refuses bad input: an `InvalidParams` whose message says what to change.
Edges map it to INVALID_ARGUMENT / HTTP 400. No dependencies, so any module may use it."""


class InvalidParams(ValueError):
    """A parameter is out of range; the message says which and why."""


def validate_that(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidParams(message)
