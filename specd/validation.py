"""The one way specd refuses bad input: an `InvalidParams` whose message says what to change.
Edges map it to INVALID_ARGUMENT / HTTP 400. No dependencies, so any module may use it."""


class InvalidParams(ValueError):
    """A parameter is out of range; the message says which and why."""


def validate_that(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidParams(message)


def valid_text(text: str, what: str) -> str:
    """`text`, if it is Unicode that UTF-8 can carry: JSON's "\\ud800" escapes decode to a lone
    surrogate, which no tokenizer or store accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidParams(f"{what} is not valid Unicode: a lone surrogate at character {error.start}") from None
    return text
