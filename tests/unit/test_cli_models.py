"""`--model` repeated, each `--alias` naming the `--model` before it; names must not collide."""

from __future__ import annotations

import pytest

from logprobe import cli
from logprobe.config import ModelSpec


def specs(*argv):
    return cli.settings_from_args(cli.build_parser().parse_args(["serve", *argv])).models


def test_aliases_follow_their_model():
    assert specs() == [ModelSpec(None, [])]
    assert specs("--alias", "smol") == [ModelSpec(None, ["smol"])]
    assert specs("--model", "a.gguf", "--alias", "x", "--model", "/m/b", "--alias", "y", "--alias", "z") == [
        ModelSpec("a.gguf", ["x"]), ModelSpec("/m/b", ["y", "z"])]
    assert specs("--alias", "early", "--model", "a", "--model", "b") == [ModelSpec("a", ["early"]), ModelSpec("b", [])]
    settings = cli.settings_from_args(cli.build_parser().parse_args(["serve", "--model", "a", "--alias", "x",
                                                                     "--model", "b"]))
    assert (settings.model, settings.aliases) == ("a", ["x"])  # the first model, for one-model callers


def test_colliding_names_are_refused(monkeypatch):
    from logprobe.engine.runners import loader

    sources = {"one": loader.ModelSource("dir", "/m/one", "org/one", ["shared"]),
               "two": loader.ModelSource("dir", "/m/two", "org/two", [])}
    monkeypatch.setattr(loader, "resolve_source", lambda name: sources[name])
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("names are checked before loading"))
    settings = cli.settings_from_args(cli.build_parser().parse_args(
        ["serve", "--model", "one", "--model", "two", "--alias", "shared"]))
    with pytest.raises(ValueError, match="'shared' is taken by two models"):
        cli.load_engines(settings)


def test_replicas_take_one_model(capsys):
    assert cli.main(["serve", "--replicas", "2", "--model", "a", "--model", "b"]) == 2
    assert "one model" in capsys.readouterr().err


def test_engines_are_built_by_one_builder(monkeypatch):
    """`logprobe serve` builds each model's engine with Engine.from_settings, as a Ray replica does, with
    the model's own aliases first and the --alias values it lacks after them."""
    from logprobe.engine.runners import loader
    from logprobe.engine.engine import Engine

    sources = {"one": loader.ModelSource("dir", "/m/one", "org/one", ["own"]),
               "two": loader.ModelSource("dir", "/m/two", "org/two", [])}
    monkeypatch.setattr(loader, "resolve_source", lambda name: sources[name])
    built = []

    def build(cls, settings, source, aliases):
        built.append((source.name, aliases))
        return source.name

    monkeypatch.setattr(Engine, "from_settings", classmethod(build))
    settings = cli.settings_from_args(cli.build_parser().parse_args(
        ["serve", "--model", "one", "--alias", "own", "--alias", "x", "--model", "two", "--alias", "y"]))
    assert cli.load_engines(settings) == ["org/one", "org/two"]
    assert built == [("org/one", ["own", "x"]), ("org/two", ["y"])]
