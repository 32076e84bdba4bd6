"""What adaptive learns while serving: decode step times drive the share of misses sent over
PCIe (shares.ShareTuner) and the placement (chooser.ModeChooser).

Driven only from `between_steps`, which the engine calls before every step: a step replayed
from one CUDA graph runs no Python inside its layers, so the time from one call to the next
is the step's time.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from freetoken import config
from freetoken.moe.chooser import ModeChooser
from freetoken.moe.locality import LocalityCheck, miss_costs, predict
from freetoken.moe.policy import Mode
from freetoken.moe.shares import ShareTuner

log = logging.getLogger(__name__)

DECODE_TOKENS = 8  # steps this small are timed (larger ones are prefill chunks or batches)
PREFILL_TOKENS = 32  # above this a step goes back to the cache whatever the placement
# The first answer after a load runs in the predicted placement; measuring begins after
# this many decode steps, and its visits take about DUTY of the steps from then on.
EXPLORE_AFTER = 512
DUTY = 0.1
PERIOD = 4096  # decode steps between two measurements
# A placement move (whole layers' experts, at times hundreds of milliseconds) and the step
# after it, which recaptures the decode graphs, count toward the visit they serve; an
# interval longer than this may span idle time as well and counts as this long.
MOVE_CHARGE_CAP = 1.0
# An interval over IDLE_FACTOR times the running step time is idle time (or a visit's first
# step), not a step. After STALE_AFTER such intervals in a row the running time is what is
# wrong: a step launched right behind the one before it (decode ahead) takes a fraction of a
# millisecond from call to call, and seeded with that, every later step was dropped and
# adaptive never measured (through the server on the H200: 1,500 steps, no visit).
IDLE_FACTOR = 5
STALE_AFTER = 8
# A measurement begins only where a mode could gain MIN_GAIN of a step, judged from the
# misses of the last WINDOW_STEPS decode steps in a row (no prefill among them, which would
# count its own misses): device's step is its dense work and its misses' fetches, so no
# placement gains more than those fetches' time.
MIN_GAIN = 0.15
WINDOW_STEPS = 64
# A window that would let a measurement in counts only where the one before it had about
# as many misses a step (within SETTLED times): a switch on trial is judged against the
# steps just served, and while the cache warms to new routing those steps miss more than
# the settled ones. Through the server (12 layers, 75 %, H100) the gate fired at the onset
# of near-uniform routing on 4.2 misses a step against 1.3-1.7 settled, split was tried
# against those steps' 1.67 ms and stood, and then served at 1.65-1.96 against device's 1.47.
SETTLED = 1.5
# A visit to split moves no expert and, after its first, replays graphs already captured:
# next to nothing where it is about as fast. And device's misses cost more than their
# fetches: at 12 layers, 75 % cached, hot routing, one stream (H100), device served 0.81
# misses a step at 1.63 ms against a 1.26 ms dense step (~0.45 ms a miss, the fetch
# kernel's 0.25), where split had served 669 tok/s in an earlier run on the same kind of
# machine against device's 613 here. So split needs only SPLIT_GAIN.
SPLIT_GAIN = 0.1
# Between device and split no expert moves, so where the gate names one from the other it is
# put on trial at once, not measured by visits (ModeChooser). A measurement's visits and
# rests at 12 layers, 75 % cached (H100), took 10 s from device, a whole four-stream window
# served in the slower mode; from split, 11 moves inside the hot four-stream windows.
TRIED = ((str(Mode.DEVICE), str(Mode.SPLIT)), (str(Mode.SPLIT), str(Mode.DEVICE)))


@dataclass
class MissWindow:
    """The misses of recent decode steps, and what they leave a measurement to gain
    (trial.Prospects). Books on the device only: where the host keeps them its round
    trips cost time a placement may save, which misses do not show."""

    lookups: Callable[[], tuple[int, int]]  # the cache's (hits, misses) totals: a device read
    miss_s: dict[Mode, float]  # each placement's seconds a miss (miss_costs)
    cpu_route_s: float  # one route's expert computed on the CPU
    cpu_layers: float  # the fraction of layers the layers placement puts on the CPU
    start: tuple[int, int] | None = None  # the totals where the window opened
    steps: int = 0  # decode steps since
    # the times of those timed as steps (not spanning idle time or a move)
    times: list[float] = field(default_factory=list)
    told: tuple[str, ...] | None = None  # device's last verdict logged
    last_rate: float | None = None  # misses a step of the window judged before

    @classmethod
    def of(cls, lookups, costs: tuple[float, float], layers: int, experts: int, capacity: int):
        """The window of a cache of `capacity` slots, from one expert's seconds over PCIe and
        on the CPU."""
        fixed = min(layers, capacity // experts)  # as Placement.place_layers fixes them
        return cls(lookups, miss_costs(*costs), costs[1], (layers - fixed) / layers)

    def ended(self, tokens: int) -> None:
        """A step of `tokens` tokens ended: a decode step counts, a prefill's misses are not
        decode's and close the window."""
        if tokens > DECODE_TOKENS:
            self.start = None
        elif tokens and self.start is not None:
            self.steps += 1

    def timed_step(self, seconds: float) -> None:
        if self.start is not None:
            self.times.append(seconds)

    def promising(self, mode: str) -> tuple[str, ...] | None:
        others = tuple(str(m) for m in self.miss_s if str(m) != mode)
        if Mode(mode) not in (Mode.DEVICE, Mode.SPLIT):
            return others
        if self.start is None or self.steps < WINDOW_STEPS or not self.times:
            if self.start is None:
                self.start, self.steps, self.times = self.lookups(), 0, []
            return None
        start, self.start = self.start, None  # judged: the next look opens a new window
        hits, misses = self.lookups()
        routes = (hits + misses - sum(start)) / self.steps
        # the window's typical step: its mean counts a few stalled steps (a share on trial,
        # a mode's first steps) as time to gain; from split at one stream (12 layers, H100)
        # whole CPU layers were visited, where their compute alone takes about the step,
        # at 2.76 ms a step against split's 1.40
        step = statistics.median(self.times)
        floor = MIN_GAIN * step
        # whole CPU layers compute every route of theirs, hit or miss
        layers = self.cpu_layers * routes * self.cpu_route_s
        if Mode(mode) is Mode.SPLIT:
            # the lane's work a layer is time no miss shows, so device and cache stay
            # promising; whole CPU layers cannot gain more than the step less their own
            # compute (at 12 layers, 75 % cached, four streams: 6 ms of it against a 3 ms step,
            # and each visit to layers cost a window up to a third of its speed)
            return tuple(m for m in others if m != Mode.LAYERS or step - layers >= floor)
        rate = (misses - start[1]) / self.steps
        gain = tuple(
            m for m in others if self._gains(Mode(m), rate * self.miss_s[Mode.DEVICE], layers, step)
        )
        last, self.last_rate = self.last_rate, rate
        if gain and (last is None or max(rate, last) > SETTLED * min(rate, last)):
            return None  # the misses are still moving: the next window decides
        self._tell(gain, rate, step)
        return gain

    @staticmethod
    def _gains(mode: Mode, own: float, layers: float, step: float) -> bool:
        """Whether `mode` could gain enough of a device step of `step` seconds, `own` of
        them its misses' fetches (`layers`: whole CPU layers' compute)."""
        if mode is Mode.SPLIT:
            return own >= SPLIT_GAIN * step
        return own - (layers if mode is Mode.LAYERS else 0.0) >= MIN_GAIN * step

    def _tell(self, gain: tuple[str, ...], misses: float, step: float) -> None:
        """Logs device's verdict where it changes: which figures kept a measurement out (or
        let one in) is what a served run's log has to show."""
        if gain == self.told:
            return
        self.told = gain
        log.info(
            "adaptive: gate: %.2f misses a step at %.3f ms a fetch against a %.3f ms step "
            "(gain floors: split %.0f %%, others %.0f %%): %s",
            misses,
            self.miss_s[Mode.DEVICE] * 1e3,
            step * 1e3,
            SPLIT_GAIN * 100,
            MIN_GAIN * 100,
            "measure " + ", ".join(gain) if gain else "no measurement",
        )


def allowed(modes: tuple[Mode, ...] | None, names: tuple[str, ...] | None):
    """The placements of `modes` that FREETOKEN_ADAPTIVE_MODES names (all with None). Where
    it names none this machine offers, all of them, and a warning: serving must not stop."""
    if not modes or names is None:
        return modes
    kept = tuple(m for m in modes if str(m) in names)
    if not kept:
        log.warning(
            "adaptive: none of %s is a placement here (%s): choosing among all",
            ",".join(names),
            ",".join(map(str, modes)),
        )
    return kept or modes


class AdaptiveTuner:
    def __init__(
        self,
        prior_share: float,
        modes: tuple[Mode, ...] | None,
        teams: tuple[float, ...] = (1.0,),
        prior_team: float = 1.0,
    ):
        """prior_share: the share of misses over PCIe served first; teams: the parts of the
        CPU lane's team measured (the setting's, where it has workers to spare)."""
        self.shares = ShareTuner(prior_share, teams=teams, prior_team=prior_team)
        # what gates a measurement: set before the chooser is made, where the books are on
        # the device
        self.window: MissWindow | None = None
        self.modes = self.mode_chooser(modes)
        self.locality: LocalityCheck | None = None  # pending at a load that learned nothing
        self._tick: float | None = None  # when the last timed step started
        self._after_move = False  # the step that started last follows a placement move
        self._batch = 0  # its tokens (a decode step's: its sequences)
        self._typical = 0.0  # a running step time, to drop intervals that span idle time
        self._dropped = 0  # intervals dropped in a row as longer than a step
        self.on_measured = None  # called with stats() when a measurement completes
        self._measured = 0
        self.moves = 0  # placement moves since load (each drops the decode graphs)

    def choose(
        self,
        modes: tuple[Mode, ...] | None,
        known: dict | None,
        shape: tuple[int, int, int],
        costs: tuple[float, float],
        lookups: Callable[[], tuple[int, int]],
        books_on_device: bool,
    ) -> None:
        """Chooses among `modes` for a cache of `shape` (layers, experts, slots), from one
        expert's seconds over PCIe and on the CPU: serving from the placement learned here
        before (`known`), else from the bandwidths' prediction, which device tries first
        where it may (the locality check). No modes: nothing to choose."""
        self.locality = self.window = None
        modes = allowed(modes, config.current().adaptive_modes)
        if not modes:
            self.modes = None
            return
        start = Mode(known["mode"]) if known and known["mode"] in modes else None
        if start is None:
            start = predict(modes, *shape, *costs)
            if Mode.DEVICE in modes and start is not Mode.DEVICE:
                layers, experts, capacity = shape
                uniform = 1 - capacity / (layers * experts)
                cost = miss_costs(*costs)
                self.locality = LocalityCheck(start, uniform, cost[start] / cost[Mode.DEVICE])
                start = Mode.DEVICE
        if Mode.DEVICE in modes and books_on_device:
            self.window = MissWindow.of(lookups, costs, *shape)
        # a start the locality check chose has no measured step behind it: the next
        # measurement comes as early as at a first load
        self.modes = self.mode_chooser(modes, start, learned=bool(known and known.get("step_ms")))
        if known:
            self._sit_out_again(known.get("sitting_out", {}))
            if self.modes is not None:
                self.modes.serve_at(known.get("by_batch", {}), known.get("batch") or 0)

    def _sit_out_again(self, sitting_out: dict[str, int]) -> None:
        """The modes a load before found slow here sit out as many measurements again: a
        visit to device at 8 GiB of the 48-layer shape took 86 ms a step against split's 34."""
        for mode, n in sitting_out.items():
            if self.modes is not None and mode in self.modes.modes:
                self.modes.sit_out(mode, n)

    def mode_chooser(
        self, modes: tuple[Mode, ...] | None, start: Mode | None = None, learned: bool = False
    ) -> ModeChooser | None:
        """A chooser over `modes`, visited twice each, serving from `start` (learned before:
        the next measurement waits a whole period); None where there is nothing to choose."""
        if not modes:
            return None
        wait = PERIOD if learned else EXPLORE_AFTER
        return ModeChooser(
            modes=modes,
            rounds=2,
            start=start,
            explore_after=wait,
            duty=DUTY,
            prospects=self.window,
            own_sizes=tuple(m for m in modes if not m.moves_layers),
            tried=TRIED,
        )

    @classmethod
    def starting(cls, known: dict | None, costs: tuple[float, float], teams: tuple[float, ...]):
        """A tuner that serves first the share and the team learned here before (`known`),
        else the bandwidths' share (one expert's seconds over PCIe and on the CPU) and the
        whole team."""
        pcie, cpu = costs
        known = known or {}
        share, team = known.get("share"), known.get("team")
        share = float(share) if isinstance(share, int | float) else cpu / (cpu + pcie)
        team = float(team) if isinstance(team, int | float) else 1.0
        return cls(share, None, teams, team)

    @property
    def share(self) -> float:
        return self.shares.share

    def team(self, mode: Mode) -> float:
        """The part of the CPU lane's team a step in `mode` runs its requests on: the one
        tuned with the share where the share is tuned, else all (whole CPU layers)."""
        return self.shares.team if mode in (Mode.CACHE, Mode.SPLIT) else 1.0

    def step_started(self, tokens: int, mode: Mode) -> bool:
        """Times the step that just ended (call to call) in `mode` and feeds the tuners;
        steps of a prefill, or spanning idle time, are not counted. True when the share of
        misses over PCIe changed (the device's copy is written only then: a kernel launch
        a step otherwise)."""
        now = time.perf_counter()
        last, self._tick = self._tick, (now if tokens <= DECODE_TOKENS else None)
        batch, self._batch = self._batch, tokens  # the step that ended: the last one started
        after_move, self._after_move = self._after_move, False
        if self.window is not None:
            self.window.ended(batch)
        if last is None or self._tick is None:
            return False
        dt = now - last
        if after_move:  # it recaptured the graphs: the visit's cost, not a step's time
            self._charge(dt)
            return False
        if self._typical and dt > IDLE_FACTOR * self._typical and self._dropped < STALE_AFTER:
            # idle time, or a visited mode's first use (on the H200 a split visit's first
            # step took 1.27 s): not a step's time, but during a visit its cost, so the rest
            # after the visit grows with it (dropped, the rest was 0.9 s after that 1.27 s)
            self._dropped += 1
            if self.modes is not None and self.modes.visiting:
                self._charge(dt)
            return False
        stale, self._dropped = self._dropped >= STALE_AFTER, 0
        self._typical = dt if stale or not self._typical else 0.9 * self._typical + 0.1 * dt
        if self.window is not None:
            self.window.timed_step(dt)
        if self.modes is not None:
            self.modes.observe(dt, batch, str(mode))
            if self.modes.completed > self._measured:
                self._measured = self.modes.completed
                self._log_decision()
                if self.on_measured is not None:
                    self.on_measured(self.learned())
        if mode in (Mode.CACHE, Mode.SPLIT):
            share = self.shares.share
            self.shares.observe(dt, batch)
            return self.shares.next_arm(tokens) != share
        return False

    def wanted(self, tokens: int, current: Mode) -> Mode:
        """The placement a step of `tokens` tokens should run in. A prefill goes back to the
        cache: whole CPU layers would compute a long prompt's experts on the CPU, where
        streaming them to the GPU is far faster; the device-kept books' modes serve it as
        they are."""
        if self.modes is None:
            return current
        if tokens <= PREFILL_TOKENS:
            return Mode(self.modes.mode_for(tokens))
        return current if current.books_on_device else Mode.CACHE

    def _log_decision(self) -> None:
        """One line a decision (a few a load): which placement serves which batch size,
        from which step times, measured at which batch sizes how many times, so a served
        run's choices can be read back from its log."""
        stats = self.modes.stats()
        times = ", ".join(f"{m} {ms:.2f}" for m, ms in sorted(stats["step_ms"].items()))
        apart = "".join(f", {b} streams {m}" for b, m in sorted(stats["by_batch"].items()))
        sampled = "; ".join(
            f"{m} " + " ".join(f"{n}@{b}" for b, n in by.items())
            for m, by in sorted(stats["sampled"].items())
        )
        if stats["tried"]:
            sampled = "none: on trial at the gate's word"
        if (ref := stats["served_ref"]) is not None:  # the mode in use: its served steps
            n, visits_s = ref
            own = f" (visits {visits_s * 1e3:.2f})" if visits_s else ""
            sampled += f"; in use judged by {n} served steps{own}"
        log.info(
            "adaptive: step ms %s (compared at %d streams); serving %s%s; %d moves, %d "
            "reverted, %d trials taken twice; visits' steps@streams: %s",
            times,
            stats["batch"],
            stats["mode"],
            apart,
            self.moves,
            stats["reverted"],
            stats["retried"],
            sampled,
        )

    def judge_locality(self, lookups) -> None:
        """Counts a decode step of the locality check; `lookups()` gives the cache's (hits,
        misses) totals (a device read: called at the first step and the last only)."""
        check = self.locality
        if check is None or self.modes is None or (judged := check.step(lookups)) is None:
            return
        self.locality = None
        mode, hits, misses = judged
        log.info(
            "adaptive: %d misses of %d routes in %d steps: %s",
            misses,
            hits + misses,
            check.steps,
            mode,
        )
        if not self.modes.adopt(str(mode)):  # a measurement under way decides instead
            return
        if mode is not Mode.DEVICE:  # device, just served, in effect measured slow here
            self.modes.sit_out(str(Mode.DEVICE))
        if self.on_measured is not None:  # a later load starts here, and measures as this one
            self.on_measured(self.learned())

    def moved(self, old: Mode, new: Mode) -> None:
        """The placement changed (between steps): the move, and the step after it, are
        charged to the measurement's visits, not timed as steps."""
        self.moves += 1
        step_ms = self.modes.stats()["step_ms"] if self.modes is not None else {}
        log.debug("adaptive placement: %s -> %s (step ms %s)", old, new, step_ms)
        if self._tick is not None:  # a decode step's move: it began at that step's start
            now = time.perf_counter()
            self._charge(now - self._tick)
            self._tick, self._after_move = now, True

    def _charge(self, seconds: float) -> None:
        # a longer interval spans idle time as well: the visit is charged the cap
        if self.modes is not None:
            self.modes.charge(min(seconds, MOVE_CHARGE_CAP))

    def learned(self) -> dict:
        """What a later load on this machine starts from (moe/learned.py)."""
        step_ms = self.modes.stats()["step_ms"] if self.modes is not None else {}
        mode = self.modes.mode if self.modes is not None else None
        batch = self.modes.batch if self.modes is not None else 0
        out = {"mode": mode, "share": self.shares.share, "team": self.shares.team}
        out |= {"step_ms": step_ms, "batch": batch}
        if self.modes is not None:
            out["sitting_out"] = self.modes.sitting_out
            out["by_batch"] = self.modes.by_batch
        return out

    def stats(self) -> dict:
        out = {"pcie_share": self.shares.stats()}
        if self.modes is not None:
            out["placement"] = {**self.modes.stats(), "moves": self.moves}
        return out
