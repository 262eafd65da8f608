"""Tokens are safe to pass as a command-line option's value."""
from __future__ import annotations

from backend.server import credentials
from singularity_sdk.cli import build_parser


def test_no_token_reads_as_an_option_on_the_command_line():
    parser = build_parser()
    for _ in range(2000):  # a bare URL-safe token started with "-" one time in 64
        token = credentials.new_token()
        assert token.startswith(credentials.TOKEN_PREFIX) and len(token) > 40
        args = parser.parse_args(["nodes", "--url", "http://127.0.0.1:1", "--token", token])
        assert args.token == token


def test_a_token_is_stored_only_as_its_hash():
    token = credentials.new_token()
    stored = credentials.hash_token(token)
    assert token not in stored and credentials.same_hash(stored, token)
    assert not credentials.same_hash(stored, credentials.new_token())
