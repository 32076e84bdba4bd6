"""`freetoken bench decode` on the tiny model (CPU): every policy asked for gives a row whose
counters add up, and a misspelt policy fails before the model is built."""

import json

import pytest
import torch

from freetoken.bench import decode, synthmodel


def test_rows_count_every_layer_and_the_lane_reports(capsys):
    decode.main(
        [
            "--model",
            "tiny",
            "--fractions",
            "--caps",
            "0,0.5",
            "--tokens",
            "4",
            "--warmup",
            "2",
            "--settle",
            "4",
            "--settle-fixed",
            "2",
            "--repeats",
            "1",
            "--policies",
            "lru-pcie,adaptive:lane",
            "--routing",
            "uniform",
            "--bw-seconds",
            "0.1",
            "--json",
        ]
    )
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    by = {(r["policy"], r["cap"]): r for r in rows}
    assert set(by) == {(p, c) for p in ("lru-pcie", "adaptive:lane") for c in (0, 0.5)}
    k = 4 * 4  # the tiny shape's top-k times its MoE layers: a token's routes
    for p in ("lru-pcie", "adaptive:lane"):
        r = by[(p, 0.5)]
        # uniform routing with room for half the experts misses, and every layer is counted
        assert 0 < r["misses_per_token"] <= k and r["hit_rate"] == pytest.approx(
            1 - r["misses_per_token"] / k
        )
    for p in ("lru-pcie", "adaptive:lane"):  # a cap of 0: no cache, every route read from the host
        r = by[(p, 0)]
        assert (r["slots"], r["hit_rate"], r["misses_per_token"]) == (0, 0, k)
        assert r["miss_gbps"] == pytest.approx(
            k * r["tok_s"] * decode_expert_bytes() / 1e9, rel=1e-6
        )
    for c in (0, 0.5):  # without a cache every single-token layer goes through the lane
        lane = by[("adaptive:lane", c)]
        assert (
            (lane["lane_served"] > 0 or c)
            and lane["lane_failed"] == 0
            and lane["lane_timeouts"] == 0
        )


def decode_expert_bytes() -> int:
    """Bytes of one expert of the tiny shape (bf16 gate, up and down)."""
    c = synthmodel.SHAPES["tiny"]
    return 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2


def test_a_misspelt_policy_fails_at_once(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--model", "tiny", "--policies", "adaptive:fast"])
    assert "unknown policy 'adaptive:fast'" in capsys.readouterr().err


def test_a_row_takes_the_counters_of_its_median_run():
    from types import SimpleNamespace

    bench = SimpleNamespace(
        host=SimpleNamespace(layers=[0, 1]), sm=SimpleNamespace(config={"num_experts_per_tok": 4})
    )
    runs = [
        (
            0.010,
            {"layers": 20, "m": 40, "q": 0, "sync_s": 0, "host_s": 0, "cpu_wait_s": 0},
        ),  # in the order run
        (0.030, {"layers": 20, "m": 60, "q": 30, "sync_s": 0, "host_s": 0, "cpu_wait_s": 0}),
        (0.020, {"layers": 20, "m": 80, "q": 20, "sync_s": 0, "host_s": 0, "cpu_wait_s": 0}),
    ]
    (row,) = decode.summarize(
        "uniform", 8, {"adaptive": runs}, 0.001, 1e6, (50, 60, 40, 50), {"adaptive": 9}, bench
    )
    # the median time is the third run's: 8 misses a token (80 over 10 tokens), a quarter fetched
    assert (
        row["tok_s"] == pytest.approx(50)
        and row["misses_per_token"] == 8
        and row["q_share"] == 0.25
    )
    assert row["median_repeat"] == 3  # where adaptive's placement is read from too
    assert row["bound_tok_s"] == pytest.approx(1 / (0.001 + 8 * 1e6 / 110e9))


def test_a_shape_of_another_family_benchmarks_alike(capsys):
    """GLM-4.5-Air's layers (a dense first layer, shared experts, sigmoid routing) at a tiny
    size: the bench builds them through their own model file and counts only MoE layers."""
    decode.main(
        ["--model", "tiny-glm4-moe", "--fractions", "--caps", "0.5", "--tokens", "4",
         "--warmup", "2", "--settle", "4", "--settle-fixed", "2", "--repeats", "1",
         "--policies", "lru-pcie", "--routing", "trace", "--bw-seconds", "0.1", "--json"]
    )  # fmt: skip
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    (row,) = [r for r in rows if r["policy"] == "lru-pcie"]
    k = 4 * 3  # top-4 over the three MoE layers (the first is dense)
    assert 0 < row["misses_per_token"] <= k
    assert row["hit_rate"] == pytest.approx(1 - row["misses_per_token"] / k)
    assert row["slots"] == 16 * 3 // 2


def test_the_gpt_oss_shape_benchmarks_with_biased_clamped_experts(capsys):
    """gpt-oss's layers (sinks, sliding and full attention, a biased router, experts with
    biases and the clamped SwiGLU) at a tiny size: the bench builds their bias banks, and
    the lane serves them."""
    decode.main(
        ["--model", "tiny-gpt-oss", "--fractions", "--caps", "0,0.5", "--tokens", "4",
         "--warmup", "2", "--settle", "4", "--settle-fixed", "2", "--repeats", "1",
         "--policies", "lru-pcie,adaptive:lane", "--routing", "uniform", "--bw-seconds", "0.1",
         "--json"]
    )  # fmt: skip
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    by = {(r["policy"], r["cap"]): r for r in rows}
    k = 4 * 4  # top-4 over four MoE layers
    r = by[("lru-pcie", 0.5)]
    assert 0 < r["misses_per_token"] <= k and r["slots"] == 16 * 4 // 2
    lane = by[("adaptive:lane", 0)]
    assert lane["lane_served"] > 0 and lane["lane_failed"] == 0
    sm = synthmodel.build("tiny-gpt-oss", torch.device("cpu"))
    assert {b for _, b in sm.banks} == {"gate_up", "down", "gate_up_bias", "down_bias"}


@pytest.mark.parametrize(
    "model,quant",
    [("tiny", "q4_K_M"), ("tiny-gpt-oss", "mxfp4"), ("tiny-deepseek-v4", "q4_K_M")],
)
def test_a_quantized_model_of_a_shape_benchmarks(capsys, model, quant):
    """--quant builds the shape's experts packed (random blocks): Q4_K_M's Q4_K gate/up
    beside Q8_0 down (rows of 128 are not whole K-quant blocks), gpt-oss's MXFP4 with its
    biases, and DeepSeek-V4's clamped experts; the lane and the cache serve them, and S
    counts packed bytes."""
    decode.main(
        ["--model", model, "--quant", quant, "--fractions", "--caps", "0,0.5", "--tokens", "4",
         "--warmup", "2", "--settle", "4", "--settle-fixed", "2", "--repeats", "1",
         "--policies", "lru-pcie,adaptive:lane", "--routing", "uniform", "--bw-seconds", "0.1",
         "--json"]
    )  # fmt: skip
    out = capsys.readouterr().out
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    by = {(r["policy"], r["cap"]): r for r in rows}
    assert by[("lru-pcie", 0.5)]["misses_per_token"] > 0
    lane = by[("adaptive:lane", 0)]
    assert lane["lane_served"] > 0 and lane["lane_failed"] == 0
    sm = synthmodel.build(model, torch.device("cpu"), quant=quant)
    want = {"q4_K_M": {"q4_k", "q8_0"}, "mxfp4": {"mxfp4"}}[quant]
    assert set(sm.formats.values()) == want
    c = synthmodel.SHAPES[model]
    bf16 = 3 * c["hidden_size"] * (c.get("moe_intermediate_size") or c["intermediate_size"]) * 2
    assert f"S = {bf16 / 1e6:.2f} MB" not in out  # packed bytes, fewer than bf16's


@pytest.mark.parametrize("shape,moe_layers", [("tiny-deepseek-v4", 4), ("tiny-glm-5.2", 2)])
def test_the_sparse_attention_shapes_benchmark_alike(capsys, shape, moe_layers):
    """DeepSeek-V4's layers (compressed attention, hash routing, hyper-connections, clamped
    experts) and GLM-5's (sparse MLA, dense first layers) at a tiny size: built through their
    model files, a random token -> experts table, decode steps through their KV pools."""
    decode.main(
        ["--model", shape, "--fractions", "--caps", "0.5", "--tokens", "4",
         "--warmup", "2", "--settle", "4", "--settle-fixed", "2", "--repeats", "1",
         "--policies", "lru-pcie", "--routing", "uniform", "--bw-seconds", "0.1", "--json"]
    )  # fmt: skip
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    (row,) = [r for r in rows if r["policy"] == "lru-pcie"]
    k = 4 * moe_layers
    assert 0 < row["misses_per_token"] <= k and row["slots"] == 16 * moe_layers // 2
