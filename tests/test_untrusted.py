"""The one input discipline (paralayer/inputs/untrusted.py), directly: each rule refuses by name,
in one line, and lets the good input through."""
from __future__ import annotations

import os

import pytest

from paralayer.inputs import untrusted as u


@pytest.mark.parametrize("out,says", [
    ("", "is empty"), (".", "names a folder"), ("d/", "names a folder"), ("..", "names a folder"),
    (".hidden", "hidden name"), ("{t}/f/x", "which is a file"), ("/sys/x", "lies under /sys"), ("/proc/x", "under /proc"),
    ("a" * 256, "at most 255"), ("a\nb", "control characters"), ("a\x1bb", "control characters")])
def test_an_output_name_is_refused_naming_the_argument(tmp_path, out, says):
    (tmp_path / "f").write_text("x")
    with pytest.raises(u.BadInput) as e:
        u.check_out(out.replace("{t}", str(tmp_path)), "--out")
    assert e.value.field == "--out" and says in e.value.message and "\n" not in str(e.value) and "\x1b" not in str(e.value)


def test_a_good_output_name_passes(tmp_path):
    assert u.check_out(str(tmp_path / "new" / "deeper" / "o"), "--out") == str(tmp_path / "new" / "deeper" / "o")


def test_an_unwritable_folder_is_refused(tmp_path, monkeypatch):
    """As root every folder is writable, so the answer of access(2) is planted."""
    monkeypatch.setattr(u.os, "access", lambda p, mode: not str(p).startswith(str(tmp_path)))
    with pytest.raises(u.BadInput, match="permission denied"):
        u.check_out(str(tmp_path / "o"), "--out")


@pytest.mark.parametrize("make,says", [
    (lambda p: os.symlink("/proc/self/environ", p), "lies under /proc"), (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), "lies under /dev"), (lambda p: os.mkdir(p), "is a folder"),
    (lambda p: None, "no such file"), (lambda p: open(p, "wb").write(b"x" * 101), "at most 100")])
def test_a_file_to_read_is_checked_before_it_is_opened(tmp_path, make, says):
    p = str(tmp_path / "x")
    make(p)
    with pytest.raises(u.BadInput) as e:
        u.read_bytes(p, "ARG", 100)
    assert e.value.field == "ARG" and says in e.value.message


def test_json_nesting_is_counted_before_json_recurses(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"cut": \n' + '{"x": ' + "[" * 200000 + "]" * 200000 + "}\n")
    got = []
    with pytest.raises(u.BadInput, match="line 3: nested 200001 levels deep"):
        for n, rec in u.jsonl_records(str(p), "DIR"):
            got.append(n)
    assert got == [1]  # the line cut short (2) is skipped, as a crash leaves it
    (tmp_path / "d.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(u.BadInput, match="nested 100000 levels"):
        u.read_json(str(tmp_path / "d.json"), "DIR")


def test_a_boolean_field_holds_a_boolean():
    u.check_bools([{"logging": {"profile": {"memory": True}}}], ["logging.profile.memory=false"])
    with pytest.raises(u.BadInput, match="must be true or false, got 2"):
        u.check_bools([], ["logging.profile.memory=2"])
    with pytest.raises(u.BadInput, match="logging.profile.memory"):
        u.check_bools([{"logging": {"profile": {"memory": "yes"}}}], [])


def test_markup_in_a_data_path_is_printed_as_text(capsys):
    """``data.path=x[/red]y --dry-run`` raised rich's MarkupError (the corpus's markup kind found it)."""
    from paralayer import cli

    assert cli.main(["data.path=x[/red]y", "--dry-run"]) == 2
    c = capsys.readouterr()
    assert "data: x[/red]y:" in c.out and c.err.startswith("error: data.path: x[/red]y: ")
