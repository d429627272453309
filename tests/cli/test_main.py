"""The ``fastdata`` command: version, help of every option, argument errors naming the option, paths
that are files or missing folders, broken pipes."""
from __future__ import annotations

import os
import sys

import pytest

import fastdata
from fastdata.cli import main
from fastdata.cli._shard_cmd import tool_main
from fastdata.shards.convert import convert
from tests.helpers.sources import opts, synth_folder


@pytest.mark.parametrize("argv", [
    ["doctor", "SHARDS", "--step-ms", "5", "--out", "OUT"],
    ["tune", "SHARDS", "--step-ms", "5", "--out", "OUT"],
    ["bench", "SHARDS", "--out", "OUT"],
    ["demo", "--json", "OUT"],
])
def test_output_path_in_a_missing_folder_is_refused_before_measuring(tmp_path, capsys, argv):
    # these commands measure for seconds to minutes, then write: a bad path must fail first, naming the option
    out = tmp_path / "no-such-folder" / "result.json"
    argv = [str(out) if a == "OUT" else str(tmp_path / "missing-shards") if a == "SHARDS" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    option = argv[argv.index(str(out)) - 1]
    assert f"argument {option}" in err and "no-such-folder" in err, err


def test_output_path_that_is_a_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["doctor", str(tmp_path), "--out", str(tmp_path)])
    assert "argument --out" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["doctor", "tune"])
@pytest.mark.parametrize("dev", ["foo", "cuda:99"])
def test_bad_device_is_an_argument_error(tmp_path, capsys, command, dev):
    with pytest.raises(SystemExit) as e:
        main([command, str(tmp_path), "--device", dev])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --device" in err and repr(dev) in err, err
    assert "must be a str" not in err  # 'foo' is a str: the message named the wrong problem


def test_size_option_beyond_float_range_is_one_line_error(tmp_path, capsys):
    from fastdata._util import parse_size
    with pytest.raises(ValueError, match="1e400"):
        parse_size("1e400")
    with pytest.raises(SystemExit) as e:  # was an OverflowError traceback out of argparse
        main(["cache", "build", str(tmp_path), "--cache", str(tmp_path / "c"), "--max-bytes", "1e400"])
    assert e.value.code == 2
    assert "argument --max-bytes" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_work_folder_that_is_a_file_is_an_argument_error(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as e:  # demo said "[Errno 17] File exists: 'afile'"
        main([command, "--dir", str(afile), "--images", "8"])
    assert e.value.code == 2
    assert "argument --dir" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastdata {fastdata.__version__}"


def _options(parser, prefix=()):
    """(command path, action) for every option and positional of ``parser`` and its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*prefix, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield prefix, action


def test_every_option_of_every_command_has_help_with_its_default():
    """What the README promises: ``--help`` on every command lists its options with their defaults."""
    from fastdata.cli._main import build_parser

    checked = 0
    for path, action in _options(build_parser()):
        where = " ".join(path) + " " + (action.option_strings[-1] if action.option_strings else action.dest)
        assert action.help, f"{where}: no help text"
        if action.option_strings and not action.required:
            assert "default" in action.help, f"{where}: help does not state the default: {action.help!r}"
        checked += 1
    assert checked >= 50


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--images", "abc"], "argument --images: expected an integer >= 1, got 'abc'"),
    (["demo", "--images", "0"], "argument --images: expected an integer >= 1, got 0"),
    (["demo", "--workers", "-1"], "argument --workers: expected an integer >= 0, got -1"),
    (["demo", "--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
    (["inspect", "x", "--show-skipped", "many"], "argument --show-skipped: expected an integer >= 0, got 'many'"),
    (["cache", "build", "src", "--cache", "c", "--max-bytes", "lots"], "argument --max-bytes:"),
    (["cache", "build", "src", "--cache", "c", "--size", "1.5"], "argument --size: expected an integer >= 1"),
])
def test_argument_errors_name_the_option_not_internal_functions(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "_positive" not in err and "_nonneg" not in err and "positive_int" not in err
    assert "invalid" not in err.replace("invalid choice", "")


def test_no_typed_option_of_any_command_names_an_internal_function(capsys):
    """Every option with a type=, in every command: a bad value names the option, not a function."""
    import re

    from fastdata.cli._main import build_parser

    checked = 0
    parser = build_parser()
    for path, action in _options(parser):
        if not action.option_strings or action.type is None or action.choices:
            continue
        try:  # parse only: a value the type accepts must not run the command
            parser.parse_args([*path, action.option_strings[-1], "not-a-value"])
        except SystemExit:
            pass
        err = capsys.readouterr().err
        if f"argument {'/'.join(action.option_strings)}:" not in err:
            continue  # the type took the text (e.g. a path); argparse complained about something else
        names = re.findall(r"invalid (\S+) value", err)
        assert not any("_" in n for n in names), f"{' '.join(path)} {action.option_strings[-1]}: {err.strip()}"
        checked += 1
    assert checked >= 10


def test_broken_pipe_ends_quietly(tmp_path, capsys, monkeypatch):
    dest = tmp_path / "out"
    convert(synth_folder(tmp_path / "src", 6), dest, opts(samples_per_shard=1))
    for command, argv in ((main, ["inspect", str(dest), "--shards"]), (main, ["verify", str(dest), "--workers", "1"]),
                          (tool_main, ["--verify", str(dest), "--workers", "1"])):
        r, w = os.pipe()
        os.close(r)  # the reader went away, as after `| head -1`
        with open(w, "w", buffering=1 << 16) as out:
            monkeypatch.setattr(sys, "stdout", out)  # here: pytest's capture swaps sys.stdout between phases
            assert command(argv) == 1
            monkeypatch.undo()  # (the closing flush goes to os.devnull, which now stands where the pipe was)
        assert capsys.readouterr().err == ""  # not "error: [Errno 32] Broken pipe"


def test_broken_pipe_elsewhere_stays_an_error(tmp_path, capsys, monkeypatch):
    """Only stdout's broken pipe is quiet: another one (a socket to a store) is still reported."""
    import fastdata.cli._main as cli_main

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    parser = cli_main.build_parser()
    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["inspect"].set_defaults(func=broken)
    assert main(["inspect", str(tmp_path)]) == 1
    assert "fastdata inspect: error: [Errno 32] Broken pipe" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "--dir", "{f}/sub"], ["demo", "--dir", "{f}/sub/deeper"],
                                  ["doctor", "--out", "{f}/x.json"]])
def test_folder_options_under_a_file_are_argument_errors(tmp_path, capsys, argv):
    # --dir afile/sub failed later with "[Errno 20] Not a directory: 'afile/sub'", naming no option; --out
    # afile/x.json said that the folder afile "does not exist"
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        main([a.format(f=f) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {argv[1]}: " in err and f"{f} is not a folder" in err, err


@pytest.mark.parametrize("argv", [
    ["doctor", "", "--step-ms", "5"],   # an AttributeError traceback: '' was taken for "no SHARDS"
    ["shard", "SRC", ""],               # wrote the shards into the current folder
    ["shard", "", "out"],               # converted the current folder
    ["verify", ""],                     # ": manifest.json: no manifest found"
    ["inspect", ""],
    ["tune", "", "--step-ms", "5"],
    ["bench", ""],
    ["cache", "build", "", "--cache", "c"],
    ["cache", "rm", "", "--cache", "c"],  # named the API's argument, fingerprint_or_prefix
])
def test_an_empty_path_argument_is_an_argument_error(argv, tmp_path, monkeypatch, capsys):
    # an empty path is an unset shell variable ($DEST), never the current folder
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SRC" / "a").mkdir(parents=True)
    (tmp_path / "SRC" / "a" / "x.jpg").write_bytes(b"not read")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected a non-empty" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SRC"]  # nothing written


def test_cli_folders_and_files_read_tilde_and_file_urls(jpeg_shards, tmp_path, monkeypatch, capsys):
    # `fastdata bench --dir "~/b"` / `demo --dir` made a folder named "~" in the current folder, and
    # `fastdata cache build --cache file:///x/c` a folder "file:"; `--out "~/r.json"` said its folder does not exist
    from fastdata.cli._args import output_file, work_folder
    from fastdata.cli._main import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert work_folder("~/b") == str(tmp_path / "b") and work_folder(f"file://{tmp_path}/b") == str(tmp_path / "b")
    assert output_file("~/r.json") == str(tmp_path / "r.json")
    assert output_file(f"file://{tmp_path}/r.json") == str(tmp_path / "r.json")
    assert main(["cache", "build", str(jpeg_shards), "--cache", f"file://{tmp_path}/c", "--size", "8",
                 "--workers", "0", "-q"]) == 0
    assert (tmp_path / "c").is_dir() and not (tmp_path / "file:").exists()
    capsys.readouterr()
    assert main(["cache", "list", "--cache", "~/c"]) == 0
    assert "1 store(s)" in capsys.readouterr().out
