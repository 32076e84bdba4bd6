"""The settings of the expert offload runtime: the CPU lane, how misses are served, the
expert cache's size. Declared here, read with every other setting by config.py (which
lists them among its own, in this order)."""

from __future__ import annotations

from freetoken.config_values import (
    MOE_POLICIES,
    Setting,
    _adaptive_modes,
    _choice,
    _fraction_or_auto,
    _nonneg_int,
    _team_parts,
    parse_bool,
    parse_size,
)

EXPERT_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "cpu_threads",
        "FREETOKEN_CPU_THREADS",
        _nonneg_int,
        "0",
        "threads for CPU compute (the CPU lane pins one to each of that many physical cores, "
        "the last ones); 0 means one per physical core, the lane's on every core but the first",
    ),
    Setting(
        "lane_spin_ms",
        "FREETOKEN_LANE_SPIN_MS",
        _nonneg_int,
        "30",
        "milliseconds the CPU lane's threads spin after a request before they nap: a request "
        "that finds them napping waits for them to wake",
    ),
    Setting(
        "lane_give_way",
        "FREETOKEN_LANE_GIVE_WAY",
        parse_bool,
        "0",
        "the CPU lane's workers run under SCHED_IDLE: a thread that wakes (the engine, the "
        "server, its client) takes a worker's core at once instead of queueing for a free one",
    ),
    # Which part of the team serves faster follows the lane's load, and the runs disagree.
    # At 12 layers, 75 % cached (few misses a step for the lane), split through the server:
    # half the team served 0.87 / 0.98 of the bound at one / four streams in one H100 run and
    # 0.84 / 0.79 in a later one, where adaptive on the whole team served 0.84-0.92.
    # At 8 GiB of the 48-layer Q4_K_M shape (some 220 misses a token, most on the lane) split
    # on half the team served hot routing at 0.69 / 0.57 and on the whole at 0.93 / 0.87,
    # 42-56 % more tokens.
    # The tuner measuring both parts cost more in trials than it found. So the whole team.
    # docs/benchmarks.md has the runs.
    Setting(
        "lane_teams",
        "FREETOKEN_LANE_TEAMS",
        _team_parts,
        "1",
        "the parts of the CPU lane's team adaptive runs the lane's share of misses on, measured "
        "with the share (moe/shares.py) where more than one: one part alone is that part always",
    ),
    Setting(
        "adaptive_modes",
        "FREETOKEN_ADAPTIVE_MODES",
        _adaptive_modes,
        "all",
        "the placements policy adaptive may serve decode from, measuring among them: all, or a "
        "comma list of cache, device, split and layers (one: that placement, its share tuned)",
    ),
    Setting(
        "split_rows",
        "FREETOKEN_SPLIT_ROWS",
        _fraction_or_auto,
        "0",
        "share of each CPU-bound miss's rows the GPU reads from host memory while the CPU lane "
        "computes the rest (a miss split by its rows); auto: from the measured bandwidths; "
        "0 (the default, as measured faster at four streams): the lane computes whole experts",
    ),
    Setting(
        "moe_policy",
        "FREETOKEN_MOE_POLICY",
        _choice(*MOE_POLICIES),
        "adaptive",
        "how routed experts that miss the GPU cache are served",
    ),
    Setting(
        "device_cache",
        "FREETOKEN_DEVICE_CACHE",
        _choice("auto", "on", "off"),
        "auto",
        "decode steps keep the expert cache's books on the device and fetch misses with a "
        "GPU kernel, so a step runs as one CUDA graph (auto: on GPUs)",
    ),
    Setting(
        "fused_fetch",
        "FREETOKEN_FUSED_FETCH",
        parse_bool,
        "1",
        "with the books on the device, the expert kernels read each miss from host memory as "
        "they compute it and write it into its slot, instead of a fetch kernel ahead of them",
    ),
    Setting(
        "lookahead",
        "FREETOKEN_LOOKAHEAD",
        _choice("on", "off"),
        "off",
        "with the books on the device, a decode step guesses the next MoE layer's experts from "
        "its router and fetches them while the current layer computes (off by default: where "
        "the guesses are poor their fetches slow every step)",
    ),
    Setting(
        "huge_pages",
        "FREETOKEN_HUGE_PAGES",
        _choice("auto", "on", "off"),
        "auto",
        "transparent huge pages for weights read from FTW (auto: where they fill faster than 4 KiB "
        "pages, measured once at load)",
    ),
    Setting(
        "fused_kernels",
        "FREETOKEN_FUSED_KERNELS",
        parse_bool,
        "1",
        "on GPUs each RMSNorm, each head norm with its rotary embedding, the router's softmax and "
        "top-k, the KV write and decode attention run as one kernel each instead of the several of "
        "the torch code (decode at bs=1 is bound by kernel count)",
    ),
    Setting(
        "cpu_lane",
        "FREETOKEN_CPU_LANE",
        _choice("auto", "on", "off"),
        "auto",
        "adaptive computes the CPU routes of single-token steps on a CPU thread fed by GPU kernels "
        "through pinned memory, so those steps stay one CUDA graph (auto: on GPUs)",
    ),
    Setting(
        "vram_budget",
        "FREETOKEN_VRAM_BUDGET",
        parse_size,
        "0",
        "total VRAM the engine may use (0: all free memory)",
    ),
    Setting(
        "expert_slots",
        "FREETOKEN_EXPERT_SLOTS",
        _nonneg_int,
        "0",
        "expert cache slots instead of sizing from the VRAM budget (on a CPU: a host-memory pool)",
    ),
    Setting(
        "cache_auto",
        "FREETOKEN_CACHE_AUTO",
        parse_bool,
        "1",
        "shrink the expert cache when other programs need VRAM, grow it back when they free it",
    ),
    Setting(
        "cache_headroom",
        "FREETOKEN_CACHE_HEADROOM",
        parse_size,
        "1GiB",
        "free VRAM the automatic cache sizing leaves for other programs",
    ),
)
