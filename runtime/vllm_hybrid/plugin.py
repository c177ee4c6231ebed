"""vLLM general plugin entry point (filled in below)."""


def register() -> None:
    pass
