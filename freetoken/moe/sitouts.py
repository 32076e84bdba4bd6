"""The modes that sit out a ModeChooser's measurements, and for how many more."""

from __future__ import annotations


class SitOuts:
    """Each mode's measurements still to sit out: one a measurement found slow, one whose
    switch a trial took back, one a locality check or a load before found slow. A
    measurement's turn counts once the asks since the last count add up to a wait: the
    gate asks every few dozen steps, and counted at each ask a slow mode sat out minutes,
    not measurements (at 8 GiB of the 48-layer shape, H200, device, found three times
    slower by the locality check, was visited 192 steps later, at 73 ms a step against
    split's 24)."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}  # measurements a mode still sits out
        self._asked = 0  # steps the gate has kept a measurement out since one last counted

    def __contains__(self, mode: str) -> bool:
        return bool(self.left.get(mode))

    def set(self, mode: str, measurements: int) -> None:
        self.left[mode] = measurements

    def at_least(self, mode: str, measurements: int) -> None:
        self.left[mode] = max(self.left.get(mode, 0), measurements)

    def turn(self, steps: int, wait: int) -> None:
        """A measurement's turn came, `steps` after the last ask: counted once the asks add
        up to `wait` steps."""
        self._asked += steps
        if self._asked < wait:
            return
        self._asked = 0
        self.left = {m: n - 1 for m, n in self.left.items() if n > 1}
