"""Fault injection for tests (importable from any test folder: pytest puts tests/ on sys.path for
the root conftest)."""

from __future__ import annotations


def inject_failure(monkeypatch, obj, name: str, on_call: int, exc: Exception) -> None:
    """Make `obj.name` raise `exc` on its `on_call`-th call (counting from 1) and work otherwise."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == on_call:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
