"""The `sluice` dispatcher (engine_image/sluice_engine/entrypoints/cli.py): each subcommand's flags come from the component
that owns it, only that component is imported, and main()'s error handling holds for every subcommand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice_engine.entrypoints import cli
from sluice_engine.entrypoints.cli import SUBCOMMANDS, build_parser, main

HEAVY = ("torch", "kopf", "grpc", "aiohttp", "uvicorn", "pydantic", "sluice_operator", "sluice_autoscaler")


def imported_after(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    probe = (f"import sys\n{code}\n"
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))))")
    out = subprocess.run([sys.executable, "-c", probe, *HEAVY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def help_of(*argv: str) -> str:
    """Code for a probe: `sluice ARGV --help` through main(), its help text swallowed."""
    return ("import contextlib, io\nfrom sluice_engine.entrypoints.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            f"        main([*{list(argv)!r}, '--help'])\n"
            "    except SystemExit:\n"
            "        pass")


def test_serve_loads_neither_the_operator_nor_the_gateway() -> None:
    assert imported_after(help_of("serve")) == set()


@pytest.mark.parametrize("command, owner", [("operator", "sluice_operator"), ("render", "sluice_operator"),
                                            ("gateway", "sluice_autoscaler")])
def test_control_plane_subcommands_load_only_their_owner(command: str, owner: str) -> None:
    assert imported_after(help_of(command)) == {owner}


def test_what_the_control_plane_runs_never_imports_torch() -> None:
    """The commands themselves, not only their flags: the operator's image has no torch."""
    loaded = imported_after("import sluice_operator.main, sluice_operator.render, sluice_autoscaler.gateway")
    assert "torch" not in loaded and {"kopf", "grpc", "aiohttp"} <= loaded


@pytest.mark.parametrize("command, flag", [("serve", "--tensor-parallel-size"), ("render", "--filename"),
                                           ("operator", "--leader-election"), ("gateway", "--scaler-port"),
                                           ("bench", "--base-url")])
def test_each_subcommand_help_through_the_console_entry(command: str, flag: str) -> None:
    out = subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", command, "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: sluice {command} ") and flag in out.stdout


def test_top_level_help_lists_every_subcommand_and_loads_no_component() -> None:
    out = subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "{serve,render,operator,gateway,usage,bench}" in out.stdout
    for name, command in SUBCOMMANDS.items():
        assert command.help.split()[0] in out.stdout, name
    assert imported_after(help_of()) == set()


@pytest.mark.parametrize("argv", [[], ["nonsense"]])
def test_a_missing_or_unknown_subcommand_is_a_usage_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2 and "usage: sluice" in capsys.readouterr().err


def test_the_operator_flags_the_chart_and_docs_pass() -> None:
    args = build_parser(["operator"]).parse_args([
        "operator", "-n", "a", "--namespace", "b", "--resync-seconds", "30", "--liveness",
        "http://0.0.0.0:8080/healthz", "--leader-election", "--lease-namespace", "sluice", "--metrics-port", "8081",
        "--log-level", "debug"])
    assert (args.namespace, args.resync_seconds, args.liveness, args.leader_election, args.lease_namespace,
            args.metrics_port, args.log_level) == (["a", "b"], 30.0, "http://0.0.0.0:8080/healthz", True, "sluice",
                                                   8081, "debug")
    defaults = build_parser(["operator"]).parse_args(["operator", "-A"])
    assert (defaults.all_namespaces, defaults.namespace, defaults.resync_seconds, defaults.leader_election,
            defaults.metrics_port) == (True, [], 60.0, False, None)
    with pytest.raises(SystemExit):  # -n and -A exclude each other
        build_parser(["operator"]).parse_args(["operator", "-A", "-n", "a"])


def test_render_flags() -> None:
    args = build_parser(["render"]).parse_args(["render", "-f", "-", "-o", "json"])
    assert (args.filename, args.output) == ("-", "json")
    with pytest.raises(SystemExit):  # -f is required
        build_parser(["render"]).parse_args(["render"])


MINIMAL = {"serve": [], "render": ["-f", "-"], "operator": [], "gateway": [], "bench": [],
           "usage": ["--prometheus", "http://127.0.0.1:9", "--tenant", "a"]}


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_main_runs_the_owner_and_turns_a_value_error_into_one_line(command: str, monkeypatch, capsys) -> None:
    seen = []

    def refuse(args):
        seen.append(args.command)
        raise ValueError("no such thing")

    owner = SUBCOMMANDS[command]
    monkeypatch.setattr(cli.importlib.import_module(owner.module), owner.run, refuse)
    assert main([command, *MINIMAL[command]]) == 2
    assert seen == [command]
    assert capsys.readouterr().err == f"sluice {command}: error: no such thing\n"


def test_a_reader_that_leaves_is_no_error() -> None:
    """`sluice render ... | head`: the pipe closes under the writer; exit 0 and no traceback."""
    code = ("import sys\nfrom sluice_engine.entrypoints import cli\nimport sluice_operator.cli as owner\n"
            "def leave(args):\n    raise BrokenPipeError\n"
            "owner.run_render = leave\nsys.exit(cli.main(['render', '-f', '-']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (0, "")
