"""Every option of every command says what it does in `--help`."""

from __future__ import annotations

import argparse

import pytest

from elmo_cli.main import parser as service_parser
from elmo_pretrain.cli import build_parser as pretrain_parser


def _options():
    for prog, p in (("elmo-service", service_parser()), ("elmo-pretrain", pretrain_parser())):
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        for cmd, cp in sub.choices.items():
            for a in cp._actions:
                if not isinstance(a, argparse._HelpAction):
                    yield f"{prog} {cmd} {'/'.join(a.option_strings) or a.dest}", a


@pytest.mark.parametrize(
    "name,action", list(_options()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_option_has_help(name, action):
    assert action.help and action.help.strip(), f"{name} has no help text"


def test_the_service_description_names_every_command():
    """`elmo-service --help` once said "core commands: convert, embed-file, info" above six."""
    p = service_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    missing = [cmd for cmd in sub.choices if cmd not in (p.description or "")]
    assert not missing, f"elmo-service --help does not name {missing}"
