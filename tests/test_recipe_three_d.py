"""lslm.recipes.three_d: settings checked before launch (``ValueError`` from the config and from ``run``, an
argparse error on the command line).

The recipe's training at dp = tp = pp = 2 (losses equal to the serial baseline's, stage-to-stage bytes exactly
the schedule's) is checked in tests/test_three_d.py, inside its one 8-process launch; its command line runs in
tests/test_readme_commands.py.
"""

from __future__ import annotations

import pytest

from lslm.recipes import three_d as R

SMALL = dict(n_layer=4, n_head=2, n_embd=32, vocab_size=1024, block_size=32, batch_size=8, steps=3, log_every=100)


def test_bad_settings_raise_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match="3 attention heads"):
        R.ThreeDConfig(**{**SMALL, "n_head": 3, "n_embd": 48})
    with pytest.raises(ValueError, match="does not divide world_size=6"):
        R.check_config(R.ThreeDConfig(**SMALL), 6)
    with pytest.raises(ValueError, match="does not divide world_size=6"):  # from run(): before the launch
        R.run(nproc=6, **SMALL)
    with pytest.raises(SystemExit) as exit_info:  # the command line: an argparse error, exit code 2
        R.main(["--nproc", "8", "--zero", "3"])
    assert exit_info.value.code == 2
    assert R.check_config(R.ThreeDConfig(**SMALL), 8) == 2

