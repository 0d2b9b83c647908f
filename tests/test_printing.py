"""lslm.runtime.printing: text progress bars everywhere (a saved notebook shows the finished bar), rank 0 only."""

from __future__ import annotations

import sys
import types

import pytest
from tqdm.std import tqdm

from lslm.runtime.printing import in_notebook_kernel, progress


def _fake_ipython(monkeypatch: pytest.MonkeyPatch, config: dict[str, object]) -> None:
    shell = types.SimpleNamespace(config=config)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))


def test_outside_a_kernel_the_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert not in_notebook_kernel()
    assert list(progress(range(3), desc="train", rank=0)) == [0, 1, 2]
    out, err = capsys.readouterr()
    assert out == "" and "train: 100%" in err and "3/3" in err


def test_in_a_kernel_the_finished_text_bar_goes_to_stdout(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _fake_ipython(monkeypatch, {"IPKernelApp": {}})
    assert in_notebook_kernel()
    bar = progress(range(60), desc="train", rank=0)
    assert type(bar) is tqdm  # the text bar, not tqdm.notebook's widget (saved as its first state, 0/60)
    for _ in bar:
        pass
    bar.close()
    out, err = capsys.readouterr()
    final = out.split("\r")[-1]  # what the saved output shows once carriage returns are applied
    assert err == "" and final.startswith("train: 100%") and "60/60" in final and final.endswith("\n")


def test_a_terminal_ipython_is_not_a_kernel_and_other_ranks_stay_silent(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _fake_ipython(monkeypatch, {"TerminalIPythonApp": {}})
    assert not in_notebook_kernel()
    assert list(progress(range(2), rank=1)) == [0, 1]
    assert capsys.readouterr() == ("", "")
