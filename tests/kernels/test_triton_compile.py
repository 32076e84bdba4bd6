"""Every Triton kernel of the dense path compiles for a Hopper GPU (sm_90), on any machine
with Triton installed: the interpreter runs the kernels' logic on the CPU, this catches what
only the GPU compiler refuses (types, shapes of dots, loops)."""

import importlib.util
import itertools
import shutil
from pathlib import Path

import pytest

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _ptxas() -> bool:
    if not HAVE_TRITON:
        return False
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


def _kernels():
    return (
        _dense_kernels()
        + _expert_kernels()
        + _packed_expert_kernels()
        + _mla_kernels()
        + _delta_kernels()
        + _sparse_kernels()
        + _books_kernels()
    )


def _packed_expert_kernels():
    """The packed-slot kernels for every format (Qwen3-30B-A3B's experts; gpt-oss's biased,
    clamped MXFP4 ones; DeepSeek-V4's clamped SwiGLU in Q4_K), the per-expert decoder, and
    the fetch into wider slots."""
    from freetoken import quant
    from freetoken.kernels.triton import fetch, moe_quant

    pair_args = {"src_a": "*bf16", "dst_a": "*bf16", "row_a": "i32", "stride_a": "i32",
                 "blocks_a": "i32", "src_b": "*u8", "dst_b": "*u8", "row_b": "i32",
                 "stride_b": "i32", "expert_ptr": "*i32", "slot_ptr": "*i32",
                 "routes": "i32"}  # fmt: skip
    out = [  # the experts as the bench gives them (int32) and as a step does (a router's int64)
        (fetch.fetch_pair_kernel, pair_args, {"BLOCK": 4096, "ROUTES": 32}),
        (
            fetch.fetch_pair_kernel,
            {**pair_args, "expert_ptr": "*i64"},
            {"BLOCK": 4096, "ROUTES": 8},
        ),
    ]
    cases = [(f, 2048, 768, False, 0) for f in quant.FORMATS.values()]
    cases.append((quant.get("mxfp4"), 2880, 2880, True, 1))
    cases.append((quant.get("q4_k"), 4096, 2048, False, 2))  # DeepSeek-V4's clamped SwiGLU
    for (f, H, I, bias, act), fill in itertools.product(cases, (False, True)):
        fmt = {"FMT": f.code, "QB": f.block, "QBYTES": f.block_bytes}
        pool = {"bias_ptr": "*bf16", "slot_ptr": "*i64"}  # the device books' slots
        # the host banks misses are filled from (stand-ins, never read, without FILL)
        hosts = {"host_ptr": "*u8", "host_bias_ptr": "*bf16", "ids_ptr": "*i64",
                 "fill_ptr": "*i32", "host_stride": "i64"}  # fmt: skip
        fills = {"FILL": fill, "ROUTES": 32}
        words = [4 if row % 4 == 0 else 2 if row % 2 == 0 else 1 for row in (f.row_bytes(H),
                 f.row_bytes(I))]  # fmt: skip
        out.append((
            moe_quant.gate_up_q_kernel,
            {**pool, **hosts, "x_ptr": "*bf16", "gu_ptr": "*u8", "h_ptr": "*fp32",
             "alpha": "fp32", "limit": "fp32"},
            {**fmt, **fills, "H": H, "I": I, "K": 8, "SLOT": 2 * I * f.row_bytes(H),
             "BLOCK_I": 16, "HAS_BIAS": bias, "ACT": act, "WORD": words[0]},
        ))  # fmt: skip
        out.append((
            moe_quant.down_q_kernel,
            {**pool, **hosts, "h_ptr": "*fp32", "dn_ptr": "*u8", "w_ptr": "*bf16",
             "out_ptr": "*fp32"},
            {**fmt, **fills, "H": H, "I": I, "SLOT": H * f.row_bytes(I), "BLOCK_H": 16,
             "HAS_BIAS": bias, "WORD": words[1]},
        ))  # fmt: skip
        if fill:
            continue
        out.append((
            moe_quant.dequant_kernel,
            {"src_ptr": "*u8", "dst_ptr": "*bf16"},
            {**fmt, "ROWS": 2 * I, "COLS": H, "BLOCK_R": 16},
        ))  # fmt: skip
    return out


def _delta_step_kernels(dt: str):
    from freetoken.kernels.triton import gated_delta

    return [
        (
            gated_delta.conv1d_step_kernel,
            {
                "x_ptr": f"*{dt}",
                "w_ptr": f"*{dt}",
                "state_ptr": f"*{dt}",
                "slots_ptr": "*i64",
                "out_ptr": f"*{dt}",
                "C": "i32",
                "x_stride": "i32",
            },
            {"K": 4, "KB": 4, "BLOCK_C": 128},
        ),
        (
            gated_delta.recurrent_step_kernel,
            {
                "qkv_ptr": f"*{dt}",
                "a_ptr": f"*{dt}",
                "b_ptr": f"*{dt}",
                "a_log_ptr": f"*{dt}",
                "dt_bias_ptr": f"*{dt}",
                "state_ptr": "*fp32",
                "slots_ptr": "*i64",
                "out_ptr": f"*{dt}",
                "qkv_stride": "i32",
                "ab_stride": "i32",
                "HK": "i32",
                "HV": "i32",
                "scale": "fp32",
            },
            {"DK": 128, "DV": 128, "BK": 128, "BV": 32},
        ),
        (
            gated_delta.gated_rms_norm_kernel,
            {"x_ptr": f"*{dt}", "z_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}",
             "D": "i32", "eps": "fp32"},
            {"BLOCK": 128},
        ),
    ]  # fmt: skip


def _delta_chunk_kernels(dt: str):
    from freetoken.kernels.triton import gated_delta_chunk

    chunk = {"C": 64, "DK": 128, "DV": 128, "BK": 128}
    precision = "ieee" if dt == "fp32" else "tf32"
    return [
        (
            gated_delta_chunk.chunk_prepare_kernel,
            {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "g_ptr": "*fp32", "beta_ptr": "*fp32",
             "cum_ptr": "*fp32", "wk_ptr": "*fp32", "wv_ptr": "*fp32", "T": "i32",
             "k_stride": "i32", "v_stride": "i32", "HK": "i32", "HV": "i32"},
            {**chunk, "BV": 128, "PRECISION": precision},
        ),
        (
            gated_delta_chunk.chunk_state_kernel,
            {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "cum_ptr": "*fp32", "wk_ptr": "*fp32",
             "wv_ptr": "*fp32", "state_ptr": "*fp32", "out_ptr": f"*{dt}", "T": "i32",
             "n_chunks": "i32", "q_stride": "i32", "k_stride": "i32", "HK": "i32",
             "HV": "i32", "scale": "fp32"},
            {**chunk, "BV": 32, "PRECISION": precision},
        ),
    ]  # fmt: skip


def _delta_kernels():
    return [
        k for dt in ("bf16", "fp32") for k in (*_delta_step_kernels(dt), *_delta_chunk_kernels(dt))
    ]


def _mla_kernels():
    from freetoken.kernels.triton import mla

    out = []
    for dt in ("bf16", "fp32"):
        for direct in (True, False):
            part = f"*{dt}" if direct else "*fp32"
            out.append(
                (
                    mla.mla_decode_kernel,
                    {
                        "q_ptr": f"*{dt}",
                        "pe_ptr": f"*{dt}",
                        "pool_ptr": f"*{dt}",
                        "table_ptr": "*i64",
                        "lens_ptr": "*i64",
                        "out_ptr": f"*{dt}",
                        "part_ptr": part,
                        "lse_ptr": part,
                        "scale": "fp32",
                        "table_stride": "i64",
                        "H": "i32",
                        "SPLITS": "i32",
                    },
                    {
                        "R": 512,
                        "R_BLOCK": 512,
                        "P": 64,
                        "P_BLOCK": 64,
                        "HB": 16,
                        "PAGE": 16,
                        "BLOCK_N": 16,
                        "DIRECT": direct,
                    },
                )
            )
        out.append(
            (
                mla.mla_merge_kernel,
                {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dt}", "SPLITS": "i32"},
                {"R": 512, "R_BLOCK": 512, "S_BLOCK": 4},
            )
        )
    return out


def _sparse_attention(dt: str, D: int, dv: int, sink: bool, direct: bool):
    from freetoken.kernels.triton import sparse

    part = f"*{dt}" if direct else "*fp32"
    sig = {
        "q_ptr": f"*{dt}",
        "pool_ptr": f"*{dt}",
        "rows_ptr": "*i32",
        "sink_ptr": "*fp32",
        "out_ptr": f"*{dt}",
        "part_ptr": part,
        "lse_ptr": part,
        "scale": "fp32",
        "pool_stride": "i64",
        "H": "i32",
        "K": "i32",
        "SPLITS": "i32",
    }
    consts = {
        "D": D,
        "DV": dv,
        "DV_BLOCK": 512,
        "DR_BLOCK": 64,
        "HB": 16,
        "BLOCK_N": 16,
        "HAS_SINK": sink,
        "DIRECT": direct,
    }
    return sparse.sparse_attention_kernel, sig, consts


def _sparse_merge(dt: str, dv: int, sink: bool):
    from freetoken.kernels.triton import sparse

    sig = {
        "part_ptr": "*fp32",
        "lse_ptr": "*fp32",
        "sink_ptr": "*fp32",
        "out_ptr": f"*{dt}",
        "H": "i32",
        "SPLITS": "i32",
    }
    consts = {"DV": dv, "DV_BLOCK": 512, "S_BLOCK": 4, "HAS_SINK": sink}
    return sparse.sparse_merge_kernel, sig, consts


def _index_scores(dt: str, heads: int):
    from freetoken.kernels.triton import indexer

    sig = {
        "q_ptr": f"*{dt}",
        "w_ptr": "*fp32",
        "pool_ptr": f"*{dt}",
        "lists_ptr": "*i32",
        "which_ptr": "*i32",
        "seen_ptr": "*i32",
        "out_ptr": "*fp32",
        "scale": "fp32",
        "pool_stride": "i64",
        "list_stride": "i64",
        "S": "i32",
    }
    consts = {"HEADS": heads, "H_BLOCK": heads, "D": 128, "D_BLOCK": 128, "BLOCK_S": 64}
    return indexer.index_scores_kernel, sig, consts


def _sparse_kernels():
    out = []
    for dt in ("bf16", "fp32"):
        # GLM-5's absorbed latent (576 = 512 + 64), and DeepSeek-V4's rows with sinks (512)
        for D, dv, sink in ((576, 512, False), (512, 512, True)):
            out += [_sparse_attention(dt, D, dv, sink, direct) for direct in (True, False)]
            out.append(_sparse_merge(dt, dv, sink))
        # GLM-5's indexer (32 heads) and DeepSeek-V4's (64), keys of 128
        out += [_index_scores(dt, heads) for heads in (32, 64)]
    return out


def _expert_kernels():
    from freetoken.kernels.triton import moe_decode

    out = []
    for dt in ("bf16", "fp32"):
        for (bias, act), (host, fill) in itertools.product(
            ((False, 0), (True, 0), (True, 1), (False, 2)),
            ((False, False), (True, False), (False, True), (True, True)),
        ):
            slot = "*i64" if dt == "bf16" else "*i32"  # slots come as either
            rows = {"gu_ptr": f"*{dt}", "bias_ptr": f"*{dt}", "slot_ptr": slot}
            # the host banks a miss split by its rows is read from, the routes' experts, and
            # how many rows of each, and the slots filled (without HOST or FILL, stand-ins
            # never read)
            hosts = {"ids_ptr": "*i64", "rows_ptr": "*i32", "fill_ptr": "*i32"}
            fills = {"FILL": fill, "ROUTES": 32}
            shape = {"H": 2880, "I": 2880}  # gpt-oss's: neither a multiple of the blocks
            out.append(
                (
                    moe_decode.gate_up_kernel,
                    {
                        **rows,
                        **hosts,
                        "x_ptr": f"*{dt}",
                        "h_ptr": "*fp32",
                        "alpha": "fp32",
                        "limit": "fp32",
                        "host_ptr": f"*{dt}",
                        "host_bias_ptr": f"*{dt}",
                    },
                    {
                        **shape,
                        **{"K": 8, "BLOCK_I": 16, "BLOCK_H": 256},
                        **{"HAS_BIAS": bias, "ACT": act, "HOST": host},
                        **fills,
                    },
                )
            )
            out.append(
                (
                    moe_decode.down_kernel,
                    {
                        **hosts,
                        "h_ptr": "*fp32",
                        "dn_ptr": f"*{dt}",
                        "bias_ptr": f"*{dt}",
                        "slot_ptr": slot,
                        "w_ptr": f"*{dt}",
                        "out_ptr": "*fp32",
                        "host_ptr": f"*{dt}",
                        "host_bias_ptr": f"*{dt}",
                    },
                    {
                        **shape,
                        **{"BLOCK_H": 32, "BLOCK_I": 256, "HAS_BIAS": bias, "HOST": host},
                        **fills,
                    },
                )
            )
        sums = {"H": 2880, "K": 8, "BLOCK_H": 1024}  # the routes' sum, into the model's dtype
        out.append((moe_decode.combine_kernel, {"out_ptr": "*fp32", "y_ptr": f"*{dt}"}, sums))
    return out


def _dense_kernels():
    from freetoken.kernels.triton import attention, mask, norm, router

    out = [
        (
            mask.mask_bits_kernel,
            {"logits_ptr": "*fp32", "bits_ptr": "*i32", "V": "i32", "W": "i32"},
            {"BLOCK": 1024},
        )
    ]
    for dt in ("bf16", "fp32"):
        act = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
        rope = {"cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "heads": "i32", "eps": "fp32"}
        out += [
            *(
                (
                    norm.rms_norm_kernel,
                    {**act, "D": "i32", "eps": "fp32"},
                    {"BLOCK": 2048, "ZERO_CENTERED": zc},
                )
                for zc in (False, True)
            ),
            *(
                (
                    norm.head_norm_rope_kernel,
                    {**act, **rope},
                    {"D": 128, "HALF": 64, "ZERO_CENTERED": zc},
                )
                for zc in (False, True)
            ),
            (
                router.topk_softmax_kernel,
                {"logits_ptr": f"*{dt}", "weights_ptr": f"*{dt}", "ids_ptr": "*i64", "E": "i32"},
                {"RENORM": True, "K": 8, "BLOCK_E": 128, "BLOCK_K": 8},
            ),
            (
                attention.merge_splits_kernel,
                {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dt}", "SPLITS": "i32"},
                {"D": 128, "S_BLOCK": 4},
            ),
            (
                attention.store_kv_kernel,
                {
                    "k_ptr": f"*{dt}",
                    "v_ptr": f"*{dt}",
                    "slots_ptr": "*i64",
                    "k_pool_ptr": f"*{dt}",
                    "v_pool_ptr": f"*{dt}",
                },
                {"W": 512, "BLOCK": 512},
            ),
        ]
        out += _attention(dt)
    return out + _sample_kernels()


def _sample_kernels():
    """Top-k sampling over Qwen3's vocabulary (151,936 logits: 75 blocks of 2048) at k = 64,
    and the wide draw's kernels (38 blocks of 4096), with a k and without."""
    from freetoken.kernels.triton import sample, sample_wide

    state = {"hist_ptr": "*i32", "top_ptr": "*i64", "k": "i32"}
    weights = {"inv_temp": "fp32", "log_min_p": "fp32"}
    wide = {"BLOCK": 4096, "NB": sample_wide.NB, "ROW": 3 * sample_wide.NB // 2 + 1}
    out = [
        (
            sample.block_top_kernel,
            {"logits_ptr": "*fp32", "V": "i32", "keys_ptr": "*i64"},
            {"KP": 64, "BLOCK": 2048},
        ),
        (
            sample.pick_kernel,
            {
                "keys_ptr": "*i64",
                "n": "i32",
                "u_ptr": "*fp32",
                "out_ptr": "*i64",
                "k": "i32",
                "inv_temp": "fp32",
                "top_p": "fp32",
                "min_p": "fp32",
            },
            {"NC": 8192, "KP": 64},
        ),
    ]
    for need in (True, False):
        out += [
            (
                sample_wide.rank_kernel,
                {"logits_ptr": "*fp32", "V": "i32", **state},
                {"PASS": p, "NEED_K": need, **wide},
            )
            for p in range(sample_wide.PASSES if need else 1)
        ]
        out.append((
            sample_wide.mass_kernel,
            {"logits_ptr": "*fp32", "V": "i32", **state, "sums_ptr": "*fp32", **weights},
            {"NEED_K": need, **wide},
        ))  # fmt: skip
        out.append((
            sample_wide.draw_kernel,
            {"logits_ptr": "*fp32", "V": "i32", **state, "sums_ptr": "*fp32", "blocks": "i32",
             "u_ptr": "*fp32", "out_ptr": "*i64", **weights},
            {"NEED_K": need, "NBLK": 64, **wide},
        ))  # fmt: skip
    return out


# decode attention's options: (window, sinks); (0, False) is the plain kernel
ATTENTION_OPTIONS = [(0, False), (4096, False), (0, True), (128, True)]


def _attention(dt: str):
    from freetoken.kernels.triton import attention

    out = []
    for direct in (True, False):
        part = f"*{dt}" if direct else "*fp32"
        for window, sinks in ATTENTION_OPTIONS:
            sig = {
                "q_ptr": f"*{dt}",
                "k_ptr": f"*{dt}",
                "v_ptr": f"*{dt}",
                "table_ptr": "*i64",
                "lens_ptr": "*i64",
                "out_ptr": f"*{dt}",
                "part_ptr": part,
                "lse_ptr": part,
                "scale": "fp32",
                "table_stride": "i64",
                "H": "i32",
                "KVH": "i32",
                "SPLITS": "i32",
            }
            consts = {
                "GROUP": 8,
                "G_BLOCK": 16,
                "D": 128,
                "PAGE": 16,
                "BLOCK_N": 64,
                "DIRECT": direct,
                "WINDOW": window,
            }
            if sinks:
                sig["sinks_ptr"] = f"*{dt}"
            else:
                consts["sinks_ptr"] = None  # no sinks: the argument is compiled out
            out.append((attention.decode_attention_kernel, sig, consts))
    return out


@pytest.mark.skipif(not _ptxas(), reason="needs triton with its GPU compiler")
def _books_kernels():
    """The device books of a decode step (moe/device_lru.py's tensors), with and without a
    share of misses left to the CPU."""
    from freetoken.kernels.triton import books

    sig = {"ids_ptr": "*i64", "slot_of_ptr": "*i32", "owner_ptr": "*i64", "stamp_ptr": "*i64",
           "clock_ptr": "*i64", "counts_ptr": "*i64", "slots_out": "*i64", "fetch_out": "*i32",
           "cpu_out": "*i1", "base": "i32", "k": "i32", "S": "i32",
           "share_ptr": "*fp32"}  # fmt: skip
    return [
        (books.assign_kernel, sig, {"STRIDE": 1024, "HAS_SHARE": share, "K": 8, "BLOCK_S": 2048})
        for share in (False, True)
    ]


def test_kernels_compile_for_hopper():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for fn, sig, consts in _kernels():
        names = fn.arg_names
        signature = {n: sig.get(n, "constexpr") for n in names}
        assert set(consts) | set(sig) == set(names), fn.__name__  # every argument given a type
        src = ASTSource(
            fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()}
        )
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn.__name__
