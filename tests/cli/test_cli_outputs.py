"""Where a command will write (and what it is given as a size) is checked before its work:
an evaluation, a sensitivity profile or a study takes minutes, and ending it in a traceback
because `--out` names a file lost that work. Each case is one line, exit 2, nothing created.

`eval --out /etc/passwd` used to run the whole suite and then raise `FileExistsError`;
`eval --cache-dir /proc/x` raised `FileNotFoundError` from the evaluator; `sensitivity --out
p.arrow` wrote Parquet that every reader of a profile then read as Arrow IPC (the suffix
decides) and failed on.
"""

from __future__ import annotations

import pytest

from tenantq.cli import main
from tenantq.reference import reference_model_path

MODEL = str(reference_model_path())

# (argv with {tmp} for the test's folder, the one line's expected text after "error: ")
CASES = [
    (["eval", "--out", "{tmp}/afile"], "--out {tmp}/afile is a file; give a folder"),
    (["eval", "--out", "{tmp}/afile/sub"],
     "--out {tmp}/afile/sub: {tmp}/afile is a file, so the folder cannot be created"),
    (["eval", "--cache-dir", "{tmp}/afile/cache"],
     "--cache-dir {tmp}/afile/cache: cannot create the cache folder"),
    (["eval", "--pool-bytes", "2GiBx"],
     "argument --pool-bytes: cannot read '2GiBx' as bytes; write e.g. 4GiB"),
    (["eval", "--pool-bytes", "0"],
     "argument --pool-bytes: must be at least 1 byte, got '0'; write e.g. 4GiB"),
    (["eval", "--pool-bytes", "1.5B"],
     "argument --pool-bytes: '1.5B' is not a whole number of bytes"),
    (["sensitivity", "--model", MODEL, "--format", "int4", "--out", "{tmp}/p.arrow"],
     "--out {tmp}/p.arrow: the file name must end in .parquet"),
    (["sensitivity", "--model", MODEL, "--format", "int4", "--out", "{tmp}/no/p.parquet"],
     "--out {tmp}/no/p.parquet: the folder {tmp}/no does not exist"),
    (["sensitivity", "--model", MODEL, "--format", "int4", "--out", "{tmp}/adir.parquet"],
     "--out {tmp}/adir.parquet is a folder"),
    (["search", "spec.toml", "--out", "{tmp}/afile"], "--out {tmp}/afile is a file; give a folder"),
    (["report", "--experiment", "x", "--out", "{tmp}/afile"], "--out {tmp}/afile is a file"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), CASES)
def test_outputs_and_sizes_are_checked_before_the_work(
    argv, expected, tmp_path, capsys, monkeypatch
):
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "adir.parquet").mkdir()
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exit_:  # argparse's own errors (a bad --pool-bytes) exit here
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"error: {expected.format(tmp=tmp_path)}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created
    assert (tmp_path / "afile").read_text() == "keep"


def test_every_subcommand_reports_argument_mistakes_in_one_line(capsys):
    # argparse's usage block used to precede the error for eval, sensitivity, search, report.
    from tenantq.cli import SUBCOMMANDS

    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--no-such-option"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"tenantq {name}: error: "), (name, err)
