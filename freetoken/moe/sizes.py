"""Which mode each decode batch size serves, and at which sizes the modes were compared
(ModeChooser): four streams' step is not one's, and a mode faster at one size may be slower
at another."""

from __future__ import annotations

from collections.abc import Iterable


class Sizes:
    """The batch sizes served in a mode of their own (another than the chooser's mode in
    use), the sizes a measurement or a trial compared the modes at, and the steps served
    since at sizes none compared them at: after `new_size` of those a size is asked of."""

    def __init__(self, new_size: int):
        self.new_size = new_size
        self.own: dict[int, str] = {}  # size: its mode, where not the mode in use
        self.compared: set[int] = set()
        self._uncompared: dict[int, int] = {}  # steps served there since last asked

    def mode_for(self, batch: int, mode: str) -> str:
        return self.own.get(batch, mode)

    def drop(self, batch: int, mode: str) -> None:
        """Forgets `batch`'s own mode, and every size's that is now `mode` (the one in use)."""
        self.own = {b: m for b, m in self.own.items() if b != batch and m != mode}

    def switch(self, batch: int, old: str, new: str, fresh: Iterable[int], apart: bool) -> None:
        """The mode in use moves from `old` to `new`, the modes compared at `batch`: it and
        each size whose own mode was `new` serve `new`. Each other size compared where `old`
        served no fresh steps (`fresh`: those it did) gives the switch's trial nothing to
        judge there, so keeps `old` where sizes may serve modes `apart`, else is asked of
        anew. A reload kept four streams in split, found faster there; device, tried at one
        stream and the faster there, then served four streams too, at 0.70 of the bound."""
        stale = self.compared.difference(fresh, self.own, [batch])
        self.drop(batch, new)
        if apart:
            self.own.update(dict.fromkeys(stale, old))
        else:
            self.forget(stale)

    def forget(self, sizes: Iterable[int]) -> None:
        """What the modes' comparison at `sizes` found no longer holds: asked of anew."""
        self.compared.difference_update(sizes)

    def restore(self, by_batch: dict[int, str], compared: int, modes: Iterable[str], mode: str):
        """The sizes a load before served in modes of their own (of `modes`, not `mode`) and
        compared at, with `compared` (none where 0)."""
        self.own = {b: m for b, m in by_batch.items() if m in modes and m != mode}
        self.compared.update(self.own, [compared] if compared else [])

    def asks(self, batch: int, judged: bool) -> bool:
        """Whether to ask of `batch` now (a step is served there): `new_size` steps served at
        a size nothing compared the modes at, once something compared them at another, and
        that no trial judges (`judged`). A measurement at one stream said nothing of four:
        through the server four streams then ran a period in the mode one stream chose, at
        0.66 of the bound where the other gave 0.83-0.87."""
        if not self.compared or batch in self.compared or judged:
            return False
        n = self._uncompared[batch] = self._uncompared.get(batch, 0) + 1
        if n < self.new_size:
            return False
        self._uncompared[batch] = 0  # asked: again `new_size` steps later if nothing decides
        return True
