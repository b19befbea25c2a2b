"""dma_compile.loading: model directories, texts and the held-out split."""

import pytest
import torch

from dma_compile.loading import HELDOUT_FRACTION, check_model_dir, read_text, split_heldout, take_windows


def test_windows_never_touch_the_heldout_part():
    ids = torch.arange(10_000)
    calib, held = split_heldout(ids)
    assert held.numel() == round(10_000 * HELDOUT_FRACTION)
    assert int(calib.max()) < int(held.min())
    windows = take_windows(calib, 5, 700, spread=True)
    assert windows.shape == (5, 700)
    assert int(windows.max()) < int(held.min())
    starts = sorted(int(w[0]) for w in windows)
    assert all(b - a >= 700 for a, b in zip(starts, starts[1:]))
    assert take_windows(held, 3, 5000, spread=False).shape == (1, 1000)


def test_model_dir_errors_name_the_argument(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory"),
             (tmp_path / "empty", "has no config.json")]
    for path, message in cases:
        with pytest.raises(ValueError, match=f"--model '{path}' {message}"):
            check_model_dir(path, "--model")
        with pytest.raises(ValueError, match=f"model directory '{path}' {message}"):
            check_model_dir(path)
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert check_model_dir(tmp_path / "empty") == str(tmp_path / "empty")


def test_text_errors_name_the_file(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for name, message in (("missing.txt", "does not exist"), ("blank.txt", "is empty"), ("latin1.txt", "not UTF-8")):
        with pytest.raises(ValueError, match=message):
            read_text(tmp_path / name)
    (tmp_path / "ok.txt").write_text("some words")
    assert read_text(tmp_path / "ok.txt") == "some words"
