"""The command line explains itself: every experiment is a sub-command of ``python -m
experiments``, with plain help texts (no reST markup, no Python reprs, no references to things
the reader cannot see), a description, a help line for every option and ``--threads`` wherever
torch computes; the old module entry points run the same commands."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from experiments import cli, commands
from experiments import fetch_data, step_profile
from experiments.overhead import cli as overhead
from experiments import reproduce as rep

NAMES = ("reproduce", "fetch_data", "run", "grid", "ttr", "ttr_cost", "overhead", "step_profile")
NAMES += ("compare",)
#: fetch_data downloads and copies files only: no torch work, no threads to choose
COMPUTING = tuple(n for n in NAMES if n != "fetch_data")


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: action.choices[name] for name in NAMES}


def _assert_plain(text: str, where: str) -> None:
    for bad in (":mod:", ":func:", ":data:", ":class:", "``"):
        assert bad not in text, f"{where}: reST markup {bad!r} in the help"
    assert not re.search(r"\{'|\{\"|': ", text), f"{where}: a Python dict in the help"
    assert not re.search(r"\[\(|\('", text), f"{where}: a Python tuple/list repr in the help"
    assert "see above" not in text.lower(), f"{where}: 'see above' with nothing above"
    assert not re.search(r"\bissue\s*#?\d+", text, re.I), f"{where}: an issue number in the help"


def test_top_level_help_lists_every_command(capsys):
    text = _help([], capsys)
    _assert_plain(text, "python -m experiments")
    for name in NAMES:
        assert re.search(rf"^\s+{name}\b", text, re.M), f"{name} not listed"
    assert "main job" in text and "--threads" in text


@pytest.mark.parametrize("name", NAMES)
def test_command_help_is_plain_and_complete(name, capsys):
    text = _help([name], capsys)
    _assert_plain(text, name)
    parser = _subparsers()[name]
    assert parser.description and len(parser.description) > 80, f"{name}: no description"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
    if name in COMPUTING:
        assert "--threads" in text and "shared" in text


def test_defaults_are_shown_readably(capsys):
    text = " ".join(_help(["compare"], capsys).split())  # argparse wraps lines
    assert "(default: 0 1 2)" in text  # --checkpoints, a list shown as the user types it
    assert "mnist_logreg 0.1" in text  # per-problem defaults written out, not a dict
    run_help = " ".join(_help(["run"], capsys).split())
    for option in ("--lr", "--seed", "--results-dir", "--threads"):
        assert option in run_help
    assert "(default: results)" in run_help and "(default: 0)" in run_help
    assert "(default: None)" not in run_help and "(default: False)" not in run_help


def test_formatter_hides_unset_defaults_and_escapes_percent():
    p = argparse.ArgumentParser(formatter_class=commands.HelpFormatter)
    p.add_argument("--a", default=None, help="unset")
    p.add_argument("--b", default=[1, 2], nargs="+", type=int, help="list")
    p.add_argument("--c", default="5%", help="percent")
    p.add_argument("--d", action="store_true", help="flag")
    text = p.format_help()
    assert "unset\n" in text and "list (default: 1 2)" in text and "(default: 5%)" in text
    assert "flag\n" in text


@pytest.mark.parametrize(
    "module, name",
    [(overhead, "overhead"), (step_profile, "step_profile"), (fetch_data, "fetch_data")],
)
def test_old_entry_points_are_aliases(module, name, capsys):
    with pytest.raises(SystemExit):
        module.main(["--help"])
    old = capsys.readouterr().out
    new = _help([name], capsys)
    assert old.split("\n\n", 1)[1] == new.split("\n\n", 1)[1]  # same text after the usage


def test_paper_figs_help_is_plain(capsys):
    from paper_figs.cli import main as figs_main

    with pytest.raises(SystemExit):
        figs_main(["--help"])
    text = capsys.readouterr().out
    _assert_plain(text, "python -m paper_figs")
    for what in ("all", "overhead", "curves", "table", "ttr", "compare"):
        assert f"  {what} " in text


def test_reproduce_alias():
    assert rep.parse_args([]).out.as_posix() == "results/reproduce"
    assert rep.parse_args(["--threads", "1", "--no-progress"]).progress is False


def test_threads_are_applied(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        argv = ["run", "mnist_logreg", "momentum", "--lr", "0.1", "--epochs", "1"]
        argv += ["--train-size", "128", "--eval-size", "64", "--synthetic", "--no-progress"]
        assert cli.main([*argv, "--results-dir", str(tmp_path), "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        with pytest.raises(SystemExit):
            cli.main([*argv, "--threads", "0"])
        assert "must be >= 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_run_shows_progress_of_training_evaluation_and_run(tmp_path, capsys):
    argv = ["run", "mnist_logreg", "momentum", "--lr", "0.1", "--epochs", "2", "--threads", "1"]
    argv += ["--train-size", "256", "--eval-size", "64", "--synthetic"]
    assert cli.main([*argv, "--results-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    for bar in ("epoch 1/2", "epoch 2/2", "eval 0/2", "eval 2/2", "epoch/s"):
        assert bar in err, f"no progress bar {bar!r}"
    # the run's bar after its first epoch: elapsed<time left
    assert re.search(r"1/2 \[\d\d:\d\d<\d\d:\d\d", err), "no estimate of the time left"
