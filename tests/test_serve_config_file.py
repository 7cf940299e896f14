"""Reading serve's configuration file: bounded, regular files only, never blocking (so
it may run off the event loop); ``--config-dir`` on the command line."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from helpers.errors import ErrCli, expect_error

from vramlock.serve.config import MAX_BYTES, ConfigError, read_config_text

pytestmark = pytest.mark.timeout(30)


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        read_config_text(str(path))
    assert err.value.exit_status == 2
    return str(err.value)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    os.mkfifo(path)
    done = threading.Event()
    outcome: list[str] = []

    def read() -> None:
        outcome.append(refused(path))
        done.set()

    threading.Thread(target=read, daemon=True).start()
    # No writer ever opens it: a blocking open would never come back.
    assert done.wait(10), "reading the FIFO blocked"
    assert outcome == [f"{path}: cannot read it: a FIFO, not a regular file"]


def test_a_link_to_dev_zero_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.symlink_to("/dev/zero")
    assert refused(path) == f"{path}: cannot read it: a character device, not a regular file"


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert refused(tmp_path) == f"{tmp_path}: cannot read it: a directory, not a regular file"


def test_a_file_past_the_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"#" * MAX_BYTES)
    assert read_config_text(str(path)) == "#" * MAX_BYTES  # the bound itself is read
    with path.open("ab") as f:
        f.write(b"#")
    assert refused(path) == f"{path}: cannot read it: larger than 4 MiB"


def test_text_that_is_not_utf_8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"models: \xff\n")
    assert refused(path) == f"{path}: cannot read it: not UTF-8 text"


def test_config_dir_merges_and_its_errors_exit_2(errcli: ErrCli, tmp_path: Path) -> None:
    directory = tmp_path / "conf.d"
    directory.mkdir()
    model = "models:\n  m:\n    cmd: sleep 60 ${PORT}\n"
    (directory / "a.yaml").write_text(model)
    (directory / "b.yml").write_text(model)
    out = errcli("serve", "--config-dir", str(directory))
    expect_error(out, 2, f"{directory / 'b.yml'}:2: models: 'm' is already in another source")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config-dir", "{d}", "--watch-config"],
         "--watch-config reads one file again: not with --config-dir"),
        ([], "give the configuration once: CONFIG or --config FILE, or --config-dir DIR"),
        (["--config-dir", "{d}/none"], "{d}/none: cannot read the directory:"),
        (["--config-dir", "{d}"], "{d}: no configuration files (*.yaml, *.yml) in it"),
    ],
    ids=["with-watch", "nothing", "no-directory", "empty"],
)  # fmt: skip
def test_config_dir_usage_errors(
    errcli: ErrCli, tmp_path: Path, args: list[str], message: str
) -> None:
    out = errcli("serve", *(a.format(d=tmp_path) for a in args))
    expect_error(out, 2, message.format(d=tmp_path))
