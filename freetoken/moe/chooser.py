"""Where decode steps place the experts, chosen by their measured step times (ModeChooser)."""

from __future__ import annotations

from collections import Counter

from freetoken.moe.rest import Rest
from freetoken.moe.sitouts import SitOuts
from freetoken.moe.sizes import Sizes
from freetoken.moe.trial import (
    GateTrials,
    Prospects,
    Served,
    Trial,
    against_served,
    close_call,
    median,
    most_sampled,
)


class ModeChooser:
    """How decode steps place the experts, chosen by measured step time among `modes`:

    cache   every layer through the cache, its books on the host, misses split between
            PCIe and the CPU;
    device  every layer through the cache, its books on the device, every miss fetched by
            a GPU kernel (no host work in a step: one CUDA graph);
    split   books on the device, a tuned share of each layer's misses fetched while the CPU
            computes the others (the host waits per layer for which routes are its own);
    layers  whole layers on the CPU, the rest fixed on the GPU (llama.cpp's --n-cpu-moe).
    Without locality in the routing, a cache holding a third of the experts hits a third of
    the time, and every layer's misses cost PCIe or CPU time; whole CPU layers move the same
    bytes with no bookkeeping (on the GPU machine 1.2–1.6× the host-kept cache at uniform
    routing, 0.7–0.8× with a skewed trace). Which is faster depends on the work being served,
    so each is measured for `measure` steps (after `settle` steps of each visit), the fastest
    is kept, and all are measured again every `period` steps. With `rounds` > 1 the modes are
    visited in turn that many times, each visit taking its share of the samples: a machine
    whose speed drifts (other work on the host's cores or memory) then slows every mode's
    samples alike instead of the ones measured last.

    A step's time depends on its batch as much as on the mode (four sequences' step is not
    one's), and the batch changes as requests come and go: each mode's samples are kept by
    batch size and the modes are compared at the size all of them were measured at most.
    With no size in common, each mode is compared with the mode in use's served steps at a
    size of its own visits: streams that start and end between visits leave a measurement
    with no size in common (through the server at 8 GiB, one and four streams in turn: 8
    moves since load and none decided). Where that fails too (the mode in use has not served
    `MIN_SERVED` steps at any size visited) the measurement decides nothing: the mode in use
    stays, and the next measurement comes `retry` steps later.

    Measuring is not free: each visit moves the placement there and back (whole layers'
    experts, hundreds of milliseconds at times), and a user waits through it. So a mode
    measured `SLOW` times the fastest's step or more sits out the next `PRUNE` measurements,
    and a measurement that keeps the mode in use doubles the wait before the next one (up to
    `MAX_BACKOFF` periods); a change brings the wait back to `period`.

    The first answer a user waits for must not pay for the measuring: serving starts in
    `start` (the mode the bandwidths predict, or the one learned before on this machine),
    the first measurement waits `explore_after` steps, and between two visits the chooser
    serves in the best mode known until what the visit cost is at most `duty` of the time
    since it began (and for `rest` steps, scaled alike). Rationed by steps alone, visits to
    a mode several times slower took far more than their share: through the server on the
    H200, adaptive at one stream ran at 0.70 of lru-pcie while measuring. A visit's cost is
    its time over the mode in use's for as many steps (all of it where the mode in use has
    no time at that size): a mode about as fast costs, and rests, next to nothing. Rested
    on the visits' whole time, a measurement of two modes in two rounds comes to some 430
    steps at a duty of 0.1 (56 of them visits: the rests' arithmetic, not a timing), most of
    a 512-step window of four streams through the server.

    A visit sees the cache as the visits before it left it: a mode that keeps no new expert
    (split at share 0) is timed on a cache the others filled, and the mode in use is timed
    after moves that stirred it (a visit to layers re-places whole layers). Through the
    server on an H100 (hot routing) adaptive timed split at 1.76 ms a step against device's
    2.28 and chose it; served at four streams, split then ran at 0.58 of lru-pcie's rate. So
    the mode in use is judged by its steps served between and before the visits (the last
    `SERVED` at the compared batch size, where there are `MIN_SERVED` of the last `FRESH`
    steps: Served), not by its own visits; and a switch is a trial: once the new mode has
    served `TRIAL` steps at the compared batch size (or at another the old mode served at
    lately; a size not judged within `FRESH` of the trial's steps is asked of anew), a median
    over `TRIAL_MARGIN` slower (any slower where no visit backs the switch: twice at 12
    layers, device stood 4 % slower than split) than the old mode's time there takes the old
    mode back, and the new one sits out the next `PRUNE` measurements, twice as many at
    each such revert (its visits will look as fast again). A verdict against the visits is
    taken twice (Trial).

    A mode found slower at a batch size the old mode served is not taken back for every
    size, only for that one: served at 12 layers with 75 % cached (H100), device was the
    faster at one stream (1.66 ms against split's 1.76) and split at four (2.25 against
    2.50), and one mode for both left one of them at 0.66-0.77 of the bound. Each size
    serves its own mode (`mode_for`); moving between them replays graphs captured before.

    Where little can be gained a measurement is all cost: through the server on an H100,
    with a cache holding 75 % of the experts and 98 % of the routes hitting, a measurement
    (a visit to layers empties the cache) cut a 512-token window's speed by up to 0.4, and
    every mode it found was the one in use. So each measurement first asks `prospects`
    (where given) which modes could gain; those it names not, and all where it names none,
    sit the measurement out. A switch in `tried` (from, to) the gate names is put on trial
    at once, no visits before: at 12 layers with 75 % cached (H100), a measurement of split
    from device took 10 s of visits and their rests (a first visit's graph capture, repaid
    at the duty's ratio), all of a four-stream window served in device at 0.68 of the
    bound, where split, 23 % faster, was chosen as the window ended (tuning.TRIED).

    A mode `SLOW` times the fastest sits out `PRUNE` measurements, one moving whole layers
    once `CLOSE` slower: at 8 GiB of the 48-layer shape (H100) layers, 1.47 times split's
    step at four streams, was visited again at one stream, and the windows holding those
    visits ran at 0.77-0.79 of the bound, their other repeats at 0.82-0.96.

    A close call is decided on more samples: where every mode's median is within `CLOSE`
    of the fastest and none moves whole layers, the modes are visited in turn again, up to
    `EXTRA_ROUNDS` more times, with no rest between (a visit to a mode that close costs
    little), and each is judged by its visits alone, all taken in the same stretch of work.
    At 12 layers with 75 % cached (H100), device and split differ by 0.1-0.2 ms a step
    while a step's misses move it by more: twelve samples a mode, against the mode in use's
    served steps from before the regime changed, found device faster at four streams in one
    load and split in the next, and either left a size at 0.70-0.79 of the bound.
    """

    SLOW = 1.5
    CLOSE = 0.15
    EXTRA_ROUNDS = 4
    PRUNE = 3
    MAX_BACKOFF = 16
    SERVED = 64
    MIN_SERVED = 16
    TRIAL = 32
    TRIAL_MARGIN = 0.05
    GATE_RETRY = 64
    NEW_SIZE = 64
    FRESH = 256

    def __init__(
        self,
        settle: int = 8,
        measure: int = 12,
        period: int = 4096,
        modes: tuple[str, ...] = ("cache", "layers"),
        rounds: int = 1,
        start: str | None = None,
        explore_after: int = 0,
        duty: float = 1.0,
        prospects: Prospects | None = None,
        own_sizes: tuple[str, ...] | None = None,
        tried: tuple[tuple[str, str], ...] = (),
    ):
        self.prospects = prospects
        self.tried = GateTrials(tried, self.GATE_RETRY * self.PRUNE)
        self.skipped = 0  # measurements skipped: no mode could gain enough
        self.settle, self.measure, self.period, self.modes = settle, measure, period, modes
        self.rounds, self._per_visit = rounds, max(1, -(-measure // rounds))
        self.mode = self.home = start if start in modes else modes[0]
        self.means: dict[str, float] = {}
        self._plan: list[str] = []  # visits still to make, in order
        self._steps = 0  # steps since the current visit began
        self._visit: list[tuple[int, float]] = []  # this visit's (batch, seconds)
        # each mode's samples of this measurement, by batch size
        self._samples: dict[str, dict[int, list[float]]] = {}
        self.batch = 0  # the batch size the last decided measurement compared the modes at
        self.sampled: dict[str, dict[int, int]] = {}  # its samples: a mode's, by batch size
        # where the mode in use was judged by its served steps, how many, and its visits'
        # median there (seconds; 0 where it had none): what its own visits would have said
        self.served_ref: tuple[int, float] | None = None
        self.retry = explore_after or max(1, period // 8)
        self.wait = period  # steps from one choice to the next measurement
        self._skips = SitOuts()
        self._since = 0  # steps since the last choice
        self._rest = Rest(settle + self._per_visit, duty)
        self._visit_s = 0.0  # the visit's time so far, its settling steps included
        self.completed = 0  # decisions made: measurements completed, and trials reverted
        # the steps each mode served outside visits, by batch size: its settled time
        self._served = Served(self.SERVED, self.FRESH)
        self._extra = 0  # rounds added to this measurement: a close call
        self._trial: Trial | None = None  # a switch on trial
        self._reverts: dict[str, int] = {}  # each mode's switches taken back
        self.retried = 0  # trials whose first verdict went against the visits (Trial)
        # batch sizes served in another mode than `mode`: where a trial found it slower. Only
        # between `own_sizes` (all modes unless named): a move the batch makes must be cheap
        self.own_sizes = modes if own_sizes is None else own_sizes
        self._sizes = Sizes(self.NEW_SIZE)
        if explore_after:
            self._since = max(0, period - explore_after)
        else:  # measure at once, every mode in order
            self._plan = list(modes) * rounds
            self.mode = self._plan[0]

    def _serve(self, seconds: float, batch: int, ran: str) -> None:
        """A step served between measurements in mode `ran`: recorded, and judged where a
        switch is on trial."""
        self._served.record(ran, batch, seconds)
        trial = self._trial
        if trial is None or ran != self.mode:
            return
        was = trial.doubted
        if (verdict := trial.judge(batch, seconds, self.TRIAL)) is None:
            self.retried += trial.doubted and not was
            if trial.steps > self.FRESH:  # the sizes it has not judged: asked of anew
                self._trial = None
                self._sizes.forget(trial.old_time)
            return
        served, old_time = verdict
        self._sizes.compared.add(batch)
        if batch == self.batch:
            self.means[self.mode] = served
        slower = served > old_time * (1 + trial.margin)
        apart = batch != self.batch and {trial.old, self.mode} <= set(self.own_sizes)
        # a decision either way, and logged: a switch that stands at the size compared too
        self.completed += (slower and apart) or (not slower and batch == self.batch)
        if slower and apart:
            self._sizes.own[batch] = trial.old  # the switch stands, except at this size
        if not slower or apart:
            if not trial.old_time:  # every size judged
                self._trial = None
            return
        self._trial = None
        times = self._reverts[self.mode] = self._reverts.get(self.mode, 0) + 1
        # a mode tried at the gate's word is tried again some steps later, and the gate
        # asked again soon; one a measurement chose sits out the next measurements
        if trial.tried:
            lost = trial.steps * (served / old_time - 1)
            self.tried.taken_back(self.mode, batch, self._served.now, lost)
        else:
            self._skips.set(self.mode, self.PRUNE * 2 ** min(times - 1, 4))
        self.mode = self.home = trial.old
        self._sizes.own = trial.own  # each size serves what it served before the switch
        self.wait = self.period
        self._since = self.period - self.GATE_RETRY if trial.tried else 0
        self.completed += 1

    def _new_size(self, batch: int) -> bool:
        """Whether to measure now: a batch size nothing compared the modes at (Sizes)."""
        judged = self._trial is not None and batch in self._trial.old_time
        return self._sizes.asks(batch, judged)

    def mode_for(self, batch: int) -> str:
        """The mode a step of `batch` sequences runs in: the visit's (or the rest's) while a
        measurement is under way, else the mode found faster at that size, else `mode`."""
        if self._plan or self.mode not in self.own_sizes:
            return self.mode
        return self._sizes.mode_for(batch, self.mode)

    def _begin(self, batch: int = 0) -> None:
        """A new measurement: the others, then the mode in use; or a switch on trial at once,
        where the gate names one of those `tried` (steps of `batch` sequences now)."""
        promising = self.modes
        if self.prospects is not None:
            if (promising := self.prospects.promising(self.mode)) is None:
                self._since = max(0, self.wait - self.GATE_RETRY)
                return
            if self._try(promising, batch):
                return
        self._trial = None
        self.home = self.mode
        unpruned = [m for m in self.modes if m != self.mode and m not in self._skips]
        others = [
            m
            for m in unpruned
            if m in promising and not self.tried.waits(self.mode, m, batch, self._served.now)
        ]
        if not others:  # every other mode sits this one out: nothing to compare
            self.skipped += bool(unpruned)
            # the gate's verdict holds for the work served now, and it costs no step to ask
            # again: waiting a period after it kept a load that began hot in device through
            # the near-uniform requests that followed (3,000 steps at 0.70-0.84 of the bound)
            gated = self.prospects is not None and bool(unpruned)
            self._since = max(0, self.wait - self.GATE_RETRY) if gated else 0
            self._skips.turn(self.GATE_RETRY if gated else self.wait, self.wait)
            return
        self._skips.turn(self.wait, self.wait)
        self._plan = (others + [self.mode]) * self.rounds
        self._since, self._steps, self._visit, self._visit_s = 0, 0, [], 0.0
        self._extra = 0
        self.mode = self._plan[0]

    def _try(self, promising: tuple[str, ...], batch: int) -> bool:
        """Whether a switch the gate names, of those `tried`, is now on trial: judged against
        the mode in use's last `TRIAL` steps served at `batch`. Where it has served fewer than
        `MIN_SERVED` there (lately), the gate is asked again soon: no measurement meanwhile.
        A size served in a mode of its own never serves the mode in use: measured instead."""
        new = self.tried.pick(self.mode, promising, self._skips.left, batch, self._served.now)
        if new is None or self._sizes.mode_for(batch, self.mode) != self.mode:
            return False
        served = list(self._served.at(self.mode, batch))
        if len(served) < self.MIN_SERVED:
            self._since = max(0, self.wait - self.GATE_RETRY)
            return True
        self._skips.turn(self.wait, self.wait)  # in place of a measurement
        self.home, self.batch, self.sampled, self.served_ref = self.mode, batch, {}, None
        self.means[self.home] = median(served[-self.TRIAL :])
        self.means.pop(new, None)  # a time of a measurement before: its trial gives one
        self._sizes.compared.add(batch)
        self.mode = new
        self._switch(batch, tried=True)
        self.wait, self._since = self.period, 0
        self.completed += 1
        return True

    def observe(self, seconds: float, batch: int = 1, ran: str | None = None) -> None:
        """One decode step of `batch` sequences took `seconds`, run in mode `ran` (the
        current mode unless named: `mode_for(batch)` between measurements)."""
        self._steps += 1
        self._served.now += 1
        if not self._plan:
            self._serve(seconds, batch, self.mode if ran is None else ran)
            self._since += 1
            if self._since >= self.wait:
                self._begin(batch)
            elif self._new_size(batch):
                since = self._since
                self._begin(batch)
                if not self._plan:  # the gate kept it out: the period's clock runs on
                    self._since = since
            return
        if self._rest:
            self._served.record(self.mode, batch, seconds)
            if self._rest.served(seconds):
                self.mode, self._steps = self._plan[0], 0
            return
        self._visit_s += seconds
        if self._steps > self.settle:  # the first steps after a switch pay for the switch
            self._visit.append((batch, seconds))
        if len(self._visit) >= self._per_visit:
            self._end_visit()

    def _end_visit(self) -> None:
        done = self._plan.pop(0)
        steps, visit = self._steps, self._visit
        by_batch = self._samples.setdefault(done, {})
        for batch, seconds in visit:
            by_batch.setdefault(batch, []).append(seconds)
        self._visit, self._steps = [], 0
        close = self._extra < self.EXTRA_ROUNDS and set(self._samples) <= set(self.own_sizes)
        if not self._plan and close and close_call(self._samples, self.CLOSE):
            self._extra += 1
            self._plan = [m for m in self._samples if m != self.home] + [self.home]
            self.mode = self._plan[0]
        elif not self._plan:
            self._decide()
        elif self._rest.steps and not self._extra and (excess := self._excess(steps, visit)) > 0:
            self._rest.begin(excess, self._visit_s)
            self.mode = self.best
        else:
            self.mode = self._plan[0]
        self._visit_s = 0.0

    def _excess(self, steps: int, visit: list[tuple[int, float]]) -> float:
        """The visit's seconds, moves included, over what the mode in use took for as many
        steps at the size the visit served most (all of them where it has not served
        `MIN_SERVED` steps there): what the visit cost the user, which the rest repays."""
        if not visit or not self._visit_s:
            return self._visit_s
        batch = Counter(b for b, _ in visit).most_common(1)[0][0]
        served = self._served.at(self.home, batch)
        if len(served) < self.MIN_SERVED:
            return self._visit_s
        return max(0.0, self._visit_s - steps * median(served))

    def _decide(self) -> None:
        """Ends a measurement: each mode's median at the batch size every mode was measured
        at most, else against the mode in use's served steps, and the fastest serves; where
        neither judges, the mode in use stays."""
        samples, self._samples = self._samples, {}
        self.sampled = {m: {b: len(v) for b, v in sorted(d.items())} for m, d in samples.items()}
        self.served_ref = None
        served = self._served.of(self.home)
        if (batch := most_sampled(samples)) is not None:
            means = {mode: median(by_batch[batch]) for mode, by_batch in samples.items()}
            own = () if self._extra else served.get(batch, ())  # a close call: visits alone
            if len(own) >= self.MIN_SERVED:  # the mode in use: its served steps there
                self.served_ref = (len(own), means.get(self.home, 0.0))
                means[self.home] = median(own)
            judged = batch, means
        elif (judged := against_served(samples, self.home, served, self.MIN_SERVED)) is not None:
            self.served_ref = (len(served[judged[0]]), 0.0)
        if judged is None:
            self.mode, self._since = self.home, max(0, self.wait - self.retry)
            return
        batch, means = judged
        self.means.update(means)
        self.batch = batch
        self._sizes.compared.add(batch)
        self.mode = min(means, key=means.get)
        if self.mode != self.home:
            self._switch(batch)
        else:
            self._sizes.drop(batch, self.mode)  # the size compared serves the winner
        fastest = self.means[self.mode]
        for mode in means:
            # a visit to whole CPU layers empties their slots: slower at all, it sits out
            slow = self.SLOW if mode in self.own_sizes else 1 + self.CLOSE
            if self.means[mode] >= slow * fastest:
                self._skips.set(mode, self.PRUNE)
        kept = self.completed and self.mode == self.home
        self.wait = min(2 * self.wait, self.MAX_BACKOFF * self.period) if kept else self.period
        self.completed += 1

    def _switch(self, batch: int, tried: bool = False) -> None:
        """`mode` replaces `home`, compared at `batch`: on trial there against `home`'s time,
        and at every other size `home` served `MIN_SERVED` steps at lately (four streams'
        step is not one's: a mode faster at one may be slower at the other); the sizes
        compared where it did not keep it (Sizes.switch)."""
        old = self.home
        served = {b: d for b, d in self._served.of(old).items() if len(d) >= self.MIN_SERVED}
        apart, own = {old, self.mode} <= set(self.own_sizes), dict(self._sizes.own)
        self._sizes.switch(batch, old, self.mode, served, apart)
        # a size served in a mode of its own does not run the new one: nothing to judge there
        times = {b: median(d) for b, d in served.items() if b not in self._sizes.own}
        visits = {} if tried else {batch: self.means[self.mode]}  # the new mode's, compared
        old_time = {**times, batch: self.means[old]}
        margin = 0.0 if tried else self.TRIAL_MARGIN  # no visit said the new mode is faster
        self._trial = Trial(old, old_time, self.settle, visits, margin, tried, own)

    def charge(self, seconds: float) -> None:
        """A placement move (and the step that recaptured its graphs) took `seconds`: counted
        with the visit it serves, so the rest after that visit grows with it."""
        if self._rest:
            self._rest.charge(seconds)
        elif self._plan:
            self._visit_s += seconds

    def adopt(self, mode: str) -> bool:
        """Serves from `mode` from now on, unless a measurement is under way (it decides);
        whether it does."""
        if self._plan or mode not in self.modes:
            return False
        self.mode = self.home = mode
        self._sizes.own = {}
        return True

    @property
    def by_batch(self) -> dict[int, str]:
        """The batch sizes served in another mode than `mode`, and theirs."""
        return dict(self._sizes.own)

    def serve_at(self, by_batch: dict[int, str], compared: int = 0) -> None:
        """Serves each size named from its mode: a load before found it faster there, and
        compared the modes at those sizes and at `compared` (none where 0), which are not
        measured again before the period is out (the first answer after a reload pays no
        visit)."""
        self._sizes.restore(by_batch, compared, self.own_sizes, self.mode)

    def sit_out(self, mode: str, measurements: int | None = None) -> None:
        """`mode` sits out the next `measurements` (PRUNE) measurements: what was learned
        of it elsewhere (a locality check, a load before) says it is slow."""
        self._skips.at_least(mode, measurements or self.PRUNE)

    @property
    def sitting_out(self) -> dict[str, int]:
        """The modes that sit out measurements still to come, and how many."""
        return dict(self._skips.left)

    @property
    def best(self) -> str:
        """Where to serve between visits: the mode that served before the measurement, until
        it has a time of its own to compare; then the fastest measured."""
        known = {m: t for m, t in self.means.items() if m in self.modes}
        return min(known, key=known.get) if self.home in known else self.home

    @property
    def reverted(self) -> int:
        """Switches a trial took back."""
        return sum(self._reverts.values())

    @property
    def visiting(self) -> bool:
        """Whether a visit is under way (a measurement's, not the rest between two)."""
        return bool(self._plan) and not self._rest

    @property
    def measuring(self) -> bool:
        """Whether a measurement is under way."""
        return bool(self._plan)

    @property
    def measured(self) -> bool:
        """Whether a measurement has completed and none is under way."""
        return not self._plan and bool(self.means)

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            "by_batch": self.by_batch,
            "step_ms": {k: v * 1e3 for k, v in self.means.items()},
            "batch": self.batch,
            "sampled": self.sampled,
            "served_ref": self.served_ref,
            "measuring": bool(self._plan),
            "reverted": self.reverted,
            "retried": self.retried,
            "tried": self._trial is not None and self._trial.tried,
            "skipped": self.skipped,
        }
