"""placeholder during development"""


def add_parser(sub) -> None:
    pass
