"""How a training command ends for the user: one line and exit status 2 for a mistake of theirs
(a LorarlError), an orderly shutdown with status 128 + N on SIGTERM or SIGINT. `python -m
recipes.grpo` runs under it, and so does each group of a sweep on one base (lorarl.driver.group)."""

from __future__ import annotations

import contextlib
import signal
import sys

from lorarl.errors import LorarlError


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised in the main thread so every finally block runs: a checkpoint
    being written is removed, then vLLM, the process groups and Ray shut down in order."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:
    # A second signal during the shutdown ends the process at once, as a second Ctrl-C should.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise Interrupted(signum)


@contextlib.contextmanager
def as_command():
    """Run the block as the command the user launched: signals become an orderly shutdown, a
    LorarlError one line on stderr and exit 2, an interruption exit 128 + the signal."""
    from lorarl.telemetry.tracking import console

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        yield
    except LorarlError as err:
        # One actionable line, no traceback: these are the user's to fix.
        console(lambda line: print(line, file=sys.stderr))(f"error: {err}")
        sys.exit(2)
    except KeyboardInterrupt as err:
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        print(
            f"interrupted by {signal.Signals(signum).name}: shut down cleanly; completed checkpoints are kept "
            "(relaunch with the same hydra.run.dir to resume)",
            file=sys.stderr,
        )
        sys.exit(128 + signum)
