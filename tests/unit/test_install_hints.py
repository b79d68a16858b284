"""What a user who installed logprobe from a checkout (as the README says) is told when an extra is
missing: the command that works there, `pip install -e '.[extra]'`, and the package index's form after it.
The missing modules are hidden from the import system (`sys.modules[name] = None`)."""

from __future__ import annotations

import sys

import pytest

from logprobe import cli, score_cli
from logprobe.config import build_parser, install_hint
from logprobe.datasets.io import DatasetError, require_data_extra


def test_the_hint_gives_the_checkout_command_first():
    hint = install_hint("ray")
    assert hint.startswith("in your checkout of logprobe, pip install -e '.[ray]'")
    assert "pip install 'logprobe[ray]'" in hint


def test_missing_data_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DatasetError) as info:
        require_data_extra()
    assert "scoring datasets needs pyarrow: in your checkout of logprobe, pip install -e '.[data]'" in info.value.message


def test_score_with_ray_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray.data", None)
    source = tmp_path / "in.txt"
    source.write_text("a\n", encoding="utf-8")
    args = build_parser().parse_args(["score", "--input", str(source), "--output", str(tmp_path / "o.parquet"),
                                      "--ray", "--quiet"])
    assert score_cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--ray scores on Ray Data, which is not installed (ray.data)" in err
    assert "pip install -e '.[ray]'" in err
    assert not (tmp_path / "o.parquet").exists()


def test_replicas_with_ray_serve_missing(monkeypatch, capsys):
    for name in ("ray", "ray.serve", "logprobe.cluster.launch", "logprobe.cluster.ray_app"):
        monkeypatch.setitem(sys.modules, name, None)
    assert cli.main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "--replicas runs on Ray Serve, which is not installed" in err
    assert "pip install -e '.[ray]'" in err


def test_the_help_says_how_to_install_ray(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "pip install -e '.[ray]' in a checkout" in " ".join(capsys.readouterr().out.split())
