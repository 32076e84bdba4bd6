"""The CPU lane: requests posted into its mailbox are served by the C++ loop on its own
thread, with the expert kernel's arithmetic, in order, and a stopped lane lets go."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from freetoken.kernels import cpu as cpu_kernel
from freetoken.kernels import reference
from freetoken.models.base import ExpertSpec
from freetoken.moe import lane as lanes
from freetoken.moe.banks import HostBanks
from freetoken.moe.lane import SEQ, CpuLane, lane_cpus
from tests.kernels import experts

L, E, H, I, K = 3, 10, 48, 24, 4

pytestmark = pytest.mark.skipif(
    cpu_kernel.extension() is None, reason="needs the compiled CPU kernel"
)


def banks(dtype=torch.float32) -> HostBanks:
    g = torch.Generator().manual_seed(0)
    raw = {}
    for layer in range(L):
        raw[(layer, "gate_up")] = torch.randn((E, 2 * I, H), generator=g).to(dtype)
        raw[(layer, "down")] = torch.randn((E, H, I), generator=g).to(dtype)
    return HostBanks(raw, dtype, pin=False, spec=ExpertSpec(H, I))


def test_a_batchs_routes_are_computed_by_the_loop_each_with_its_tokens_activations():
    """A decode batch of T tokens posts T·k routes, token-major: each CPU route's expert runs
    on its own token's row, a repeated expert on each of its tokens, and a smaller request
    after a larger one reads only its own routes."""
    hb = banks()
    lane = CpuLane(hb, torch.device("cpu"), threads=2)
    lane.start()
    g = torch.Generator().manual_seed(3)
    try:
        for step, T in enumerate((4, 1, 8, 2, 1, 3)):
            layer = step % L
            x, y = torch.randn((T, H), generator=g), torch.randn((T, H), generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            ids[-1, 0] = ids[0, 0]  # one expert routed from two tokens
            w = torch.rand((T, K), generator=g)
            cpu = torch.rand(T * K, generator=g) < 0.7
            lane.post(layer, x, ids, w, cpu)
            got = lane.collect(y)
            sel = torch.nonzero(cpu).reshape(-1)
            want = y + cpu_kernel.moe_experts(
                x, hb.banks[layer], sel // K, ids.reshape(-1)[sel], w.reshape(-1)[sel], hb.spec
            )
            assert got.shape == (T, H)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"step {step}"
        with pytest.raises(AssertionError, match="too large"):
            lane.post(
                0, torch.zeros(9, H), torch.zeros((9, K), dtype=torch.int64), torch.ones(9, K)
            )
    finally:
        lane.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_posted_routes_are_computed_by_the_loop(dtype):
    hb = banks(dtype)
    lane = CpuLane(hb, torch.device("cpu"), threads=2)
    lane.start()
    g = torch.Generator().manual_seed(1)
    routes = K  # the whole CPU layer below
    try:
        for step in range(40):
            layer = step % L
            x = torch.randn((1, H), generator=g)
            ids = torch.randperm(E, generator=g)[:K][None]
            w = torch.rand((1, K), generator=g)
            cpu = torch.rand(K, generator=g) < 0.6
            y = torch.randn((1, H), generator=g)
            lane.post(layer, x, ids, w, cpu)
            routes += int(cpu.sum())
            got = lane.collect(y)
            bk = hb.banks[layer]
            sel = torch.nonzero(cpu).reshape(-1)
            want = y + cpu_kernel.moe_experts(
                x, bk, torch.zeros(len(sel), dtype=torch.int64), ids[0, sel], w[0, sel], hb.spec
            )
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"step {step}"
        # every route on the CPU (a whole CPU layer), and a layer with none
        x, ids, w = (
            torch.randn((1, H), generator=g),
            torch.arange(K)[None],
            torch.full((1, K), 0.25),
        )
        lane.post(1, x, ids, w)
        want = cpu_kernel.moe_experts(
            x, hb.banks[1], torch.zeros(K, dtype=torch.int64), ids[0], w[0], hb.spec
        )
        assert torch.allclose(lane.collect(torch.zeros(1, H)), want, rtol=1e-5, atol=1e-5)
        y = torch.randn((1, H))
        lane.post(2, x, ids, w, torch.zeros(K, dtype=torch.bool))
        assert torch.equal(lane.collect(y), y)
        stats = lane.stats()
        assert (
            stats["failed"] == 0
            and stats["timeouts"] == 0
            and stats["threads"] == len(lane.cpus) >= 1
        )
        assert stats["served"] == int(lane.count) and stats["served"] >= 20
        # the CPU's time and routes per request are what the bench reports of the lane
        assert stats["routes_per_request"] * stats["served"] == pytest.approx(routes)
        assert stats["cpu_us_per_request"] > 0 and stats["polls_per_request"] >= 0
        # the loop's thread stays on the first of its cores (its team's workers on the others)
        assert os.sched_getaffinity(lane._thread.native_id) == {lane.cpus[0]}
    finally:
        lane.stop()
    assert lane._thread is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_posted_first_row_leaves_the_rows_before_it_to_the_gpu(dtype):
    """A miss split by its rows: the lane computes rows [first, I) of each CPU route (with
    the down bias), as the kernel does with the same first row, and a request without one
    the whole expert."""
    hb = banks(dtype)
    lane = CpuLane(hb, torch.device("cpu"), threads=2)
    lane.start()
    g = torch.Generator().manual_seed(4)
    I = hb.spec.intermediate
    try:
        for step, first in enumerate((I // 2, 1, 0, I - 1, I // 3)):
            x, y = torch.randn((1, H), generator=g), torch.randn((1, H), generator=g)
            ids, w = torch.randperm(E, generator=g)[:K][None], torch.rand((1, K), generator=g)
            cpu = torch.rand(K, generator=g) < 0.6
            cpu[0] = True
            lane.post(step % L, x, ids, w, cpu, torch.tensor([first], dtype=torch.int32))
            sel = torch.nonzero(cpu).reshape(-1)
            tok = torch.zeros(len(sel), dtype=torch.int64)
            want = cpu_kernel.moe_experts(
                x, hb.banks[step % L], tok, ids[0, sel], w[0, sel], hb.spec, first_row=first
            )
            got = lane.collect(y)
            assert torch.allclose(got, y + want, rtol=1e-5, atol=1e-5), f"step {step}"
        lane.post(0, x, ids, w, cpu)  # no first row: every row, as before
        whole = cpu_kernel.moe_experts(x, hb.banks[0], tok, ids[0, sel], w[0, sel], hb.spec)
        assert torch.allclose(lane.collect(y), y + whole, rtol=1e-5, atol=1e-5)
        assert lane.stats()["failed"] == 0
    finally:
        lane.stop()


def test_the_spin_window_and_giving_way_are_the_settings_unless_given(monkeypatch):
    from freetoken import config

    monkeypatch.setenv("FREETOKEN_LANE_SPIN_MS", "7")
    config.current.cache_clear()
    try:
        assert CpuLane(banks(), torch.device("cpu"), threads=1).spin_us == 7000
        assert CpuLane(banks(), torch.device("cpu"), threads=1, spin_ms=0).spin_us == 0
        assert not lanes.make(banks(), torch.device("cpu")).give_way
        monkeypatch.setenv("FREETOKEN_LANE_GIVE_WAY", "1")
        config.current.cache_clear()
        assert lanes.make(banks(), torch.device("cpu")).give_way
    finally:
        monkeypatch.undo()
        config.current.cache_clear()


@pytest.mark.parametrize("spin_ms,give_way", [(0, False), (2, False), (2, True)])
def test_requests_back_to_back_and_after_naps_on_a_team_of_every_core(spin_ms, give_way):
    """The team's workers join a request while it is open and the loop waits only for those
    that joined: requests posted back to back, and after the workers have gone to nap (at
    once where they spin for 0 ms), each get the kernel's bits; so too where the workers run
    under SCHED_IDLE, giving their cores way to this test's thread, which posts and collects."""
    import time

    hb = banks()
    cores = len(cpu_kernel.physical_cpus())
    lane = CpuLane(hb, torch.device("cpu"), threads=cores, spin_ms=spin_ms, give_way=give_way)
    lane.start()
    g = torch.Generator().manual_seed(8)
    try:
        for step in range(300):
            layer = step % L
            x, w = torch.randn((1, H), generator=g), torch.rand((1, K), generator=g)
            ids = torch.randperm(E, generator=g)[:K][None]
            if step % 100 == 99:
                time.sleep(0.01)  # past the spinning: the workers nap
            lane.post(layer, x, ids, w)
            got = lane.collect(torch.zeros(1, H))
            want = cpu_kernel.moe_experts(
                x, hb.banks[layer], torch.zeros(K, dtype=torch.int64), ids[0], w[0], hb.spec
            )
            assert torch.equal(got, want), f"step {step}"
        assert lane.stats()["failed"] == 0 and lane.stats()["served"] == 300
        # the workers (every pinned thread but the loop's) under SCHED_IDLE where asked
        assert _idle_policy_threads() == (len(lane.cpus) - 1 if give_way else 0)
    finally:
        lane.stop()


def test_a_cut_team_runs_every_pass_on_its_members_while_the_others_nap():
    """Cut to its loop's thread, the team runs each pass there alone, with the kernel's bits,
    and the worker left out naps instead of spinning (its core is the host's); asked for in
    full again, the worker spins between requests and joins them."""
    import time

    hb = banks()
    lane = CpuLane(hb, torch.device("cpu"), threads=2, spin_ms=60_000)
    if len(lane.cpus) < 2:
        pytest.skip("one core: no worker to leave out")
    others = _pinned_threads(lane.cpus[1])  # another lane's loop may share the core
    lane.start()
    g = torch.Generator().manual_seed(9)

    def serve(n: int) -> None:
        for step in range(n):
            layer = step % L
            x, w = torch.randn((1, H), generator=g), torch.rand((1, K), generator=g)
            ids = torch.randperm(E, generator=g)[:K][None]
            lane.post(layer, x, ids, w)
            want = cpu_kernel.moe_experts(
                x, hb.banks[layer], torch.zeros(K, dtype=torch.int64), ids[0], w[0], hb.spec
            )
            assert torch.equal(lane.collect(torch.zeros(1, H)), want), f"step {step}"

    def worker_busy(seconds: float) -> float:
        """The share of `seconds` the worker ran on its core."""
        (tid,) = _pinned_threads(lane.cpus[1]) - others
        before = _cpu_ticks(tid)
        time.sleep(seconds)
        return (_cpu_ticks(tid) - before) / os.sysconf("SC_CLK_TCK") / seconds

    try:
        lane.size_team(0.0)  # at least the loop's thread
        serve(100)
        stats = lane.stats()
        assert stats["team"] == 1 and stats["members_per_pass"] == 1.0
        napping = worker_busy(0.5)
        lane.size_team(1.0)
        joined, passes = (int(lane.ctl[i]) for i in (lanes.JOINED, lanes.PASSES))
        for _ in range(40):  # it joins a pass it finds open: this one's are short
            serve(25)
            if int(lane.ctl[lanes.JOINED]) - joined > int(lane.ctl[lanes.PASSES]) - passes:
                break
        else:
            raise AssertionError("the worker taken back joined no pass")
        assert lane.stats()["team"] == len(lane.cpus)
        spinning = worker_busy(0.5)  # within its spin window: on its core throughout
        assert napping < 0.3 < spinning, (napping, spinning)
    finally:
        lane.stop()


def _pinned_threads(cpu: int) -> set[int]:
    """This process's threads pinned to `cpu` alone (a lane's)."""
    tids = (int(task.name) for task in Path("/proc/self/task").glob("*"))
    return {tid for tid in tids if _affinity(tid) == {cpu}}


def _affinity(tid: int) -> set[int]:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # a thread that ended meanwhile
        return set()


def _cpu_ticks(tid: int) -> int:
    """A thread's user and system time in clock ticks (its stat's fields 14 and 15)."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[14 - 3]) + int(fields[15 - 3])


SCHED_IDLE = 5  # Linux's policy number


def _idle_policy_threads() -> int:
    """This process's threads scheduled under SCHED_IDLE (/proc: a thread's stat, field 41)."""
    count = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            fields = stat.read_text().rsplit(")", 1)[1].split()
            count += int(fields[41 - 3]) == SCHED_IDLE
    return count


def test_the_lanes_threads_nap_as_long_as_asked():
    """The loop's thread and each worker set their timer slack to 1 us: with Linux's default
    of 50 us a 50 us nap took twice as long, and so did a request that found them napping."""
    import glob
    import time

    if not os.path.exists("/proc/self/timerslack_ns"):
        pytest.skip("no timer slack to read here")

    def precise() -> set[str]:
        """This process's threads at 1 us (a thread's own file is under its id, not its task)."""
        out = set()
        for task in glob.glob("/proc/self/task/*"):
            tid = os.path.basename(task)
            with contextlib.suppress(OSError), open(f"/proc/{tid}/timerslack_ns") as f:
                if int(f.read()) == 1000:
                    out.add(tid)
        return out

    before = precise()  # an earlier test's lane may still be winding down
    lane = CpuLane(banks(), torch.device("cpu"), threads=2)
    lane.start()
    try:
        deadline = time.monotonic() + 10
        while len(precise() - before) < len(lane.cpus) and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers start on their own threads
        assert len(precise() - before) == len(lane.cpus)
    finally:
        lane.stop()


@pytest.mark.parametrize("variant", list(experts.VARIANTS))
def test_the_loop_computes_every_kind_of_expert(variant):
    """The spec's biases and activation (gpt-oss's clamp, reached here) travel to the loop:
    its answers are the plain-torch reference's."""
    spec = experts.spec(variant, H, I)
    g = torch.Generator().manual_seed(4)
    raw = {}
    for layer in range(L):
        raw |= {(layer, b): t for b, t in experts.banks(E, spec, torch.float32, g).items()}
    hb = HostBanks(raw, torch.float32, pin=False, spec=spec)
    lane = CpuLane(hb, torch.device("cpu"), threads=1)
    lane.start()
    try:
        for step in range(6):
            layer = step % L
            x, w = torch.randn((1, H), generator=g), torch.rand((1, K), generator=g)
            ids = torch.randperm(E, generator=g)[:K][None]
            lane.post(layer, x, ids, w)
            got = lane.collect(torch.zeros(1, H))
            want = reference.moe_experts(x, ids, w, hb.banks[layer], spec)
            assert float((got - want).norm() / want.norm()) <= 1e-5, f"step {step}"
        assert lane.stats()["failed"] == 0
    finally:
        lane.stop()


def test_a_bf16_models_packed_banks_are_served_as_the_kernel_serves_them():
    """The compute dtype travels to the loop: a BF16 model's Q4_K banks get int8 activations
    there too (where the CPU has the kernels), the answers moe_experts gives for BF16."""
    spec = ExpertSpec(512, 256, formats=("q4_k", "q4_k"))
    g = torch.Generator().manual_seed(6)
    raw, formats = {}, {}
    for layer in range(2):
        for b, t in experts.packed_banks(4, spec, g).items():
            raw[(layer, b)], formats[(layer, b)] = t, "q4_k"
    hb = HostBanks(raw, torch.bfloat16, pin=False, spec=ExpertSpec(512, 256), formats=formats)
    lane = CpuLane(hb, torch.device("cpu"), threads=1)
    lane.start()
    try:
        x, ids, w = torch.randn((1, 512), generator=g), torch.tensor([[0, 2, 3]]), torch.rand(1, 3)
        lane.post(1, x, ids, w)
        got = lane.collect(torch.zeros(1, 512))
        args = (x, hb.banks[1], torch.zeros(3, dtype=torch.int64), ids[0], w[0], hb.specs[1])
        want = cpu_kernel.moe_experts(*args, compute_dtype=torch.bfloat16)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        if cpu_kernel.extension().has_int8_kernel(3):  # not fp32 activations' answer
            assert not torch.allclose(got, cpu_kernel.moe_experts(*args), rtol=1e-5, atol=1e-5)
    finally:
        lane.stop()


def test_the_lane_leaves_the_first_core_to_the_rest_of_the_host():
    """By default the team takes every physical core but the first: the threads that wake
    during a step (the event loop, the HTTP server, the engine once its step ends) find a
    core without taking one from a worker the whole request waits for. A count given keeps
    the first cores free; one core is the lane's."""
    cores = [0, 2, 4, 6]  # one logical CPU a core, as physical_cpus gives them
    assert lane_cpus(cores) == [2, 4, 6]
    assert lane_cpus(cores, 2) == [4, 6]
    assert lane_cpus(cores, 4) == cores  # every core, when asked for
    assert lane_cpus([3]) == [3]
    lane = CpuLane(banks(), torch.device("cpu"))
    lane.start()
    try:
        x, ids, w = torch.randn((1, H)), torch.tensor([[1, 2, 3, 4]]), torch.full((1, K), 0.5)
        lane.post(0, x, ids, w)
        lane.collect(torch.zeros(1, H))
        physical = cpu_kernel.physical_cpus()
        assert lane.cpus == lane_cpus(physical) and lane.stats()["threads"] == len(lane.cpus)
        if len(physical) > 1:
            assert physical[0] not in lane.cpus
            assert physical[0] not in os.sched_getaffinity(lane._thread.native_id)
    finally:
        lane.stop()


def test_a_request_posted_before_the_loop_starts_is_served():
    hb = banks()
    lane = CpuLane(hb, torch.device("cpu"), threads=1)
    x, ids, w = torch.randn((1, H)), torch.tensor([[1, 2, 3, 4]]), torch.full((1, K), 0.5)
    lane._thread = None
    lane.post(0, x, ids, w)  # posted with no loop running
    lane.start()
    try:
        want = cpu_kernel.moe_experts(
            x, hb.banks[0], torch.zeros(K, dtype=torch.int64), ids[0], w[0], hb.spec
        )
        assert torch.allclose(lane.collect(torch.zeros(1, H)), want, rtol=1e-5, atol=1e-5)
    finally:
        lane.stop()


def test_a_lane_that_is_not_running_raises_instead_of_hanging():
    lane = CpuLane(banks(), torch.device("cpu"), threads=1)
    lane.post(0, torch.randn((1, H)), torch.tensor([[1, 2, 3, 4]]), torch.ones((1, K)))
    with pytest.raises(RuntimeError, match="did not answer"):
        lane.collect(torch.zeros(1, H))


def lane_engine(tiny_model, device: str, policy: str, slots: int):
    """An engine on `device` with the device-kept books and the lane on (on a GPU, decode
    steps captured), and its experts' backend."""
    from tests.runtime.engine_util import make_engine

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = make_engine(
        tiny_model[0],
        policy=policy,
        slots=slots,
        device=device,
        device_cache="on",
        cpu_lane="on",
        graphs="capture" if device == "cuda" else "",
    )
    return engine, engine.model.model.layers[0].mlp.experts.backend


# "none": no expert cache at all, every layer through the lane (on a GPU the setup always
# sizes a cache, so only the CPU runs it; the kernels are the ones "layers" uses)
CASES = [
    ("split", "cuda"),
    ("layers", "cuda"),
    ("split", "cpu"),
    ("layers", "cpu"),
    ("none", "cpu"),
]


@pytest.mark.parametrize(
    "mode,device",
    [pytest.param(m, d, marks=[pytest.mark.gpu] if d == "cuda" else []) for m, d in CASES],
)
def test_adaptive_through_the_lane_matches_transformers(tiny_model, mode, device, monkeypatch):
    """Adaptive held in `split` (a share of each layer's misses on the CPU) or `layers`
    (whole CPU layers), the CPU's routes served by the lane: transformers' greedy tokens,
    no host work inside decode steps of one token or a batch (on a GPU: one captured graph
    per step). In split the tuner, asked to, runs the lane's requests on all and on half its
    team in turn (a team of two cores at least), in layers on all of it."""
    from freetoken import config
    from freetoken.moe import chooser
    from tests import fixtures
    from tests.runtime.engine_util import generate

    hf = tiny_model[1]
    monkeypatch.setenv("FREETOKEN_LANE_TEAMS", "1,0.5")
    if len(cpu_kernel.physical_cpus()) >= 2:
        monkeypatch.setenv("FREETOKEN_CPU_THREADS", "2")
    config.current.cache_clear()
    engine, backend = lane_engine(
        tiny_model, device, "adaptive", {"split": 9, "layers": 8, "none": 0}[mode]
    )
    config.current.cache_clear()
    if mode != "none":
        backend.tuner.modes = chooser.ModeChooser(modes=(mode,))
    else:
        assert backend.cache is None
    teams, size_team = [], backend.lane.size_team
    backend.lane.size_team = lambda part: (teams.append(part), size_team(part))
    try:
        for p in ([(5 * i) % 500 + 3 for i in range(11)], [(7 * i) % 500 + 1 for i in range(40)]):
            (seq,) = generate(
                engine, [p], 32
            )  # in split the share tuner tries every share and team meanwhile
            assert seq.output_ids == fixtures.hf_greedy(hf, p, 32)
        assert backend.placement.mode == mode or backend.cache is None
        if mode == "split" and len(backend.lane.cpus) >= 2:
            assert set(teams) == {1.0, 0.5}
        elif mode == "layers":
            assert set(teams) == {1.0}
        backend.lane.size_team = size_team
        # a decode batch's CPU routes go through the lane as one token's do
        assert all(backend.device_only(l, n) for l in engine.model.moe_layers for n in (1, 4, 8))
        assert not all(backend.device_only(l, 9) for l in engine.model.moe_layers)
        posted, post = [], backend.lane.post
        backend.lane.post = lambda layer, x, *a: (posted.append(x.shape[0]), post(layer, x, *a))
        prompts = [[(3 * i + j) % 500 + 2 for i in range(6 + j)] for j in range(3)]
        for seq, p in zip(generate(engine, prompts, 12), prompts):
            assert seq.output_ids == fixtures.hf_greedy(hf, p, 12)
        backend.lane.post = post
        # the three sequences' decode steps posted as one request (on a GPU: while the
        # batch's graph was captured, the first time that size ran)
        assert 3 in posted
        before = backend.steps
        generate(engine, [[9, 8, 7]], 4)
        d = {k: backend.steps[k] - before[k] for k in ("layers", "m", "cpu_routes")}
        # every layer of every step is counted (the bench's hit rate and bound divide by them),
        # and a CPU layer's routes are misses of the cache (split's share may leave the CPU none)
        assert d["layers"] == 4 * len(engine.model.moe_layers)
        assert d["m"] > 0 and (d["cpu_routes"] > 0 or mode == "split")
        if mode != "split":  # 3 prompt tokens and 3 decode steps, replayed steps included
            k = engine.model.args.num_experts_per_tok
            assert d["cpu_routes"] == 6 * k * len(backend.placement.cpu_layers)
        lane = backend.stats()["lane"]
        assert lane["served"] > 0 and lane["failed"] == 0 and lane["timeouts"] == 0
        if device == "cuda":  # and the engine waits for each step asleep, its cores the lane's
            assert engine.graphs.capture and backend._wait is not None
            assert {
                len(bk.segments) for (b, _), bk in engine.graphs._buckets.items() if b == 1
            } == {1}
    finally:
        backend.lane.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cpu_misses_computes_its_misses_through_the_lane(tiny_model, device):
    """cpu-misses with the lane keeps the books on the device at a share of 0: every miss
    of a single-token step goes to the lane, none is fetched, and the tokens are
    transformers' greedy ones (on a GPU: each step one captured graph)."""
    from tests import fixtures
    from tests.runtime.engine_util import generate

    hf = tiny_model[1]
    engine, backend = lane_engine(tiny_model, device, "cpu-misses", 9)
    try:
        assert backend.placement.mode == "split" and backend.lane is not None
        p = [(7 * i) % 500 + 1 for i in range(40)]
        (seq,) = generate(engine, [p], 32)
        assert seq.output_ids == fixtures.hf_greedy(hf, p, 32)
        assert all(backend.device_only(l, 1) for l in engine.model.moe_layers)
        # a prompt short enough to be a decode batch: no step of it fetches (a long prompt's
        # chunks fetch their misses, as every policy's prefill does)
        before = backend.steps
        (seq,) = generate(engine, [[9, 8, 7]], 16)
        assert seq.output_ids == fixtures.hf_greedy(hf, [9, 8, 7], 16)
        d = {k: backend.steps[k] - before[k] for k in ("m", "q")}
        assert d["m"] > 0 and d["q"] == 0
        lane = backend.stats()["lane"]
        assert lane["served"] > 0 and lane["routes_per_request"] > 0
        assert lane["failed"] == 0 and lane["timeouts"] == 0
    finally:
        backend.lane.stop()


@pytest.mark.gpu
def test_misses_split_by_their_rows_match_transformers(tiny_model, monkeypatch):
    """cpu-misses with half of each miss's rows read by the GPU from host memory while the
    lane computes the other half (FREETOKEN_SPLIT_ROWS=0.5): transformers' greedy tokens,
    each single-token step one captured graph; with 0 no miss is split."""
    from freetoken import config
    from tests import fixtures
    from tests.runtime.engine_util import generate

    hf = tiny_model[1]
    for share, first in (("0.5", 16), ("0", None)):
        monkeypatch.setenv("FREETOKEN_SPLIT_ROWS", share)
        config.current.cache_clear()
        engine, backend = lane_engine(tiny_model, "cuda", "cpu-misses", 9)
        try:
            rows = backend.shared.rows
            assert (None if rows is None else int(rows)) == first  # of 32 rows an expert
            for p in ([(7 * i) % 500 + 1 for i in range(40)], [9, 8, 7]):
                (seq,) = generate(engine, [p], 24)
                assert seq.output_ids == fixtures.hf_greedy(hf, p, 24)
            lane = backend.stats()["lane"]
            assert lane["served"] > 0 and lane["failed"] == 0 and lane["timeouts"] == 0
            assert {
                len(bk.segments) for (b, _), bk in engine.graphs._buckets.items() if b == 1
            } == {1}
        finally:
            backend.lane.stop()
    monkeypatch.undo()
    config.current.cache_clear()


def test_the_warm_up_gives_the_cpu_nothing():
    """At load the lane's kernels run once with no CPU route: nothing is posted, nothing
    served, and the next request is the first the loop sees."""
    hb = banks(torch.bfloat16)
    lane = CpuLane(hb, torch.device("cpu"), threads=1)
    lane.start()
    try:
        lane.warm(torch.bfloat16)
        assert int(lane.count) == 0 and int(lane.pend) == 0 and int(lane.ctl[SEQ]) == 0
        x, ids, w = torch.randn((1, H)), torch.arange(K)[None], torch.full((1, K), 0.25)
        lane.post(1, x, ids, w)
        want = cpu_kernel.moe_experts(
            x, hb.banks[1], torch.zeros(K, dtype=torch.int64), ids[0], w[0], hb.spec
        )
        got = lane.collect(torch.zeros(1, H))
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2)
        assert lane.stats()["served"] == 1 and lane.stats()["failed"] == 0
    finally:
        lane.stop()


INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


def _gpu_step(lane, x, y, ids, w, cpu, layer: int) -> torch.Tensor:
    """One layer's post of T tokens (x [T, H], ids and w [T·K] token-major) straight into
    the host mailbox, and the collect: y plus the CPU's routes, as the GPU step would have it."""
    from freetoken.kernels.triton import lane as kernels
    from freetoken.moe.lane import MAX_SPINS

    T, h = x.shape[0], lane.host
    mailbox = (h.x, h.ids, h.wts, h.pos, lane.ctl, lane.pend, lane.count, lane.whole)
    kernels.post_kernel[(1,)](
        x, ids, w, cpu, *mailbox, layer, K, T, H=H, BLOCK_H=32, K=32, FENCE=False
    )
    out = torch.empty_like(y)
    books = (lane.out, lane.ctl, lane.pend, lane.count, lane.polls, MAX_SPINS)
    kernels.collect_kernel[(1,)](y, out, *books, T, H=H, BLOCK_H=32)
    return out


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_gpu_kernels_drive_the_loop_in_the_interpreter():
    """The post and collect kernels (run by Triton's interpreter on host tensors) against the
    loop: the CPU's routes added to y, and a layer with none for the CPU posts nothing."""
    hb = banks()
    lane = CpuLane(hb, torch.device("cpu"), threads=1)
    lane.start()
    g = torch.Generator().manual_seed(2)
    try:
        for step, T in enumerate((1, 3, 1, 4, 2, 1, 8, 1)):  # a batch's rows, then one token's
            x, y = torch.randn((T, H), generator=g), torch.randn((T, H), generator=g)
            ids = torch.cat([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            w, cpu = torch.rand(T * K, generator=g), torch.rand(T * K, generator=g) < 0.5
            if step == 5:  # nothing for the CPU: the mailbox and the number stay as they were
                cpu[:] = False
                before = (lane.host.raw.clone(), int(lane.ctl[SEQ]))
            out = _gpu_step(lane, x, y, ids, w, cpu, step % L)
            if step == 5:
                assert torch.equal(lane.host.raw, before[0]) and int(lane.ctl[SEQ]) == before[1]
                assert torch.equal(out, y)
            sel = torch.nonzero(cpu).reshape(-1)
            want = y + cpu_kernel.moe_experts(
                x, hb.banks[step % L], sel // K, ids[sel], w[sel], hb.spec
            )
            assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), f"step {step}"
        assert lane.stats()["timeouts"] == 0
    finally:
        lane.stop()
