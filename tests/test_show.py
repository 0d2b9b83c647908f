"""lslm.show: source listings trimmed to the idea, with the full source one call away."""

import inspect

import pytest

from lslm.show import show_source, trimmed_source


def _example(n: int, mode: str = "a") -> int:
    """Add one to n.

    A long explanation that a notebook listing does not need.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if not isinstance(n, int):
        raise TypeError("n must be an int")
    if mode == "a":
        step = 1
    else:
        raise ValueError("mode must be 'a'")
    if check_me():
        n += 0
    return n + step


def check_me() -> bool:
    """A stand-in for an optional consistency check."""
    return False


def test_checks_folded_and_docstring_summarised():
    text, hidden = trimmed_source(_example)
    assert '"""Add one to n. [...]"""' in text
    assert "long explanation" not in text and "raise" not in text
    assert "# ... 2 input checks hidden ..." in text  # two consecutive checks: one line
    assert "# ... else: input check hidden ..." in text
    assert "step = 1" in text and "return n + step" in text
    full = inspect.getsource(_example).splitlines()
    assert hidden == len(full) - len(text.splitlines())


def test_full_and_options():
    assert trimmed_source(_example, full=True) == (inspect.getsource(_example).rstrip("\n"), 0)
    text, _ = trimmed_source(_example, docstring="full", checks=False, elide=("if check_me",))
    assert "long explanation" in text and "raise TypeError" in text
    assert "# ... [if check_me(): ...] hidden" in text and "n += 0" not in text
    text, _ = trimmed_source(_example, docstring="none")
    assert '"""' not in text


def test_start_stop_and_errors(capsys):
    text, _ = trimmed_source(_example, start="if mode", stop="return")
    assert text.splitlines()[0].strip() == 'if mode == "a":' and text.splitlines()[-1].strip() == "return n + step"
    with pytest.raises(ValueError, match="start='nowhere'"):
        trimmed_source(_example, start="nowhere")
    with pytest.raises(ValueError, match="docstring must be one of"):
        trimmed_source(_example, docstring="short")
    show_source(_example)
    out = capsys.readouterr().out
    assert "show_source(_example, full=True) prints all" in out


def _with_markers(n: int) -> int:
    """A listing with the package's lint markers in it."""
    x = n * 2  # keep this comment  # lslm: cpu-ok (a test of show_source)
    # lslm: cpu-ok (a marker on a line of its own)
    return x  # lslm: cpu-ok


@pytest.mark.parametrize("full", [False, True])
def test_lint_markers_are_not_shown(full, capsys):
    show_source(_with_markers, full=full)
    out = capsys.readouterr().out
    assert "lslm:" not in out and "cpu-ok" not in out
    assert "x = n * 2  # keep this comment\n" in out  # the learner's comment stays, no trailing blanks
    assert "    return x\n" in out
    assert len(out.strip().splitlines()) == 4  # def, docstring, x = ..., return: the marker-only line is gone


def test_lint_markers_of_package_code_are_not_shown(capsys):
    from lslm.exercises import model_state_bytes

    assert "# lslm: cpu-ok" in inspect.getsource(model_state_bytes._loss)
    show_source(model_state_bytes._loss)
    out = capsys.readouterr().out
    assert "lslm:" not in out and "torch.randint(0, 64, (2, 8))\n" in out
