"""Inductor integration (placeholder; filled in below)."""


def install() -> None:
    return None
