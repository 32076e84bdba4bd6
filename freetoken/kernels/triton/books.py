"""One layer's expert-cache bookkeeping for a decode step, as one kernel.

The same books as `DeviceLRU`'s device ops (look up, stamp the hits, evict the oldest
stamps, remap, count), but in one program instead of ~40 small launches: at bs=1 each of
those costs a few microseconds even inside a CUDA graph, and 48 layers of them were ~6 ms
of a token. One program sees the whole slot pool (BLOCK_S >= slots), so picking the
victims is K arg-mins over registers, each victim's stamp raised as it is taken — the
same order as a top-k, since every new stamp is larger than any earlier one.

A step of several tokens routes some experts more than once: only an expert's first route
is looked up, stamped, counted and fetched (the books of one call of its distinct experts,
in order of first appearance), and every route then takes its expert's slot from that first
route, so two tokens never fetch one expert into two slots.
"""

import triton
import triton.language as tl


@triton.jit
def assign_kernel(
    ids_ptr,
    slot_of_ptr,
    owner_ptr,
    stamp_ptr,
    clock_ptr,
    counts_ptr,
    slots_out,
    fetch_out,
    cpu_out,
    base,
    k,
    S,
    share_ptr,
    STRIDE: tl.constexpr,
    HAS_SHARE: tl.constexpr,
    K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    r = tl.arange(0, K)
    rmask = r < k
    flat = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64) + base
    first = _first_routes(flat, r, rmask) & rmask
    slots = tl.load(slot_of_ptr + flat, mask=rmask, other=0).to(tl.int64)
    miss = (slots < 0) & first
    hit = (slots >= 0) & first
    m = tl.sum(miss.to(tl.int32), axis=0)
    fetched = miss
    if HAS_SHARE:
        q = tl.floor(m.to(tl.float32) * tl.load(share_ptr) + 0.5).to(tl.int32)
        fetched = miss & (tl.cumsum(miss.to(tl.int32), axis=0) <= q)
    # the distinct experts stamped in order of first appearance
    clock = tl.load(clock_ptr)
    now = clock * STRIDE + tl.cumsum(first.to(tl.int64), axis=0) - 1
    tl.store(stamp_ptr + slots, now, mask=hit)
    tl.debug_barrier()  # the hits' new stamps are seen by every thread before victims are picked

    victims = _victims(stamp_ptr, fetched, r, S, K, BLOCK_S)

    old = tl.load(owner_ptr + victims, mask=fetched, other=-1)
    tl.store(slot_of_ptr + old, tl.full((K,), -1, tl.int32), mask=fetched & (old >= 0))
    tl.debug_barrier()  # an evicted entry is cleared before any new one is written
    tl.store(slot_of_ptr + flat, victims.to(tl.int32), mask=fetched)
    tl.store(owner_ptr + victims, flat, mask=fetched)
    tl.store(stamp_ptr + victims, now, mask=fetched)

    _count(counts_ptr, hit, miss, fetched, old)
    tl.store(clock_ptr, clock + 1)
    final = _final_slots(flat, slots, hit, fetched, victims, first)
    tl.store(slots_out + r, final, mask=rmask)
    tl.store(fetch_out + r, tl.where(fetched, victims, -1).to(tl.int32), mask=rmask)
    tl.store(cpu_out + r, final < 0, mask=rmask)


@triton.jit
def _final_slots(flat, slots, hit, fetched, victims, first):
    """Each route's slot once the books are written, as reading them back would give it, from
    registers (a barrier and a dependent reload of the books less, on a layer's critical
    path): a fetched route its victim; a hit its slot, unless a fetch of this step took it; a
    route left to the CPU -1; a repeated expert's route its first route's."""
    taken = (victims[None, :] == slots[:, None]) & fetched[None, :]
    taken_any = tl.sum(taken.to(tl.int32), axis=1) > 0
    own = tl.where(fetched, victims, tl.where(hit & ~taken_any, slots, -1))
    its_first = (flat[:, None] == flat[None, :]) & first[None, :]
    return tl.sum(tl.where(its_first, own[None, :], 0), axis=1)


@triton.jit
def _first_routes(flat, r, rmask):
    """Whether each route is its expert's first in the step (K² compares: K is at most a
    few dozen routes)."""
    earlier = (flat[:, None] == flat[None, :]) & (r[None, :] < r[:, None]) & rmask[None, :]
    return tl.sum(earlier.to(tl.int32), axis=1) == 0


@triton.jit
def _victims(stamp_ptr, fetched, r, S, K: tl.constexpr, BLOCK_S: tl.constexpr):
    """A slot for each route to fetch: the oldest stamps, taken one at a time, the j-th
    fetched route (in route order) taking the j-th oldest. Only as many arg-mins over the
    pool as there are fetches: a step that misses nothing (most, with a warm cache) reads
    no stamp, where K arg-mins a layer whatever the misses were 8-32 block-wide reductions
    of a single program, a layer's longest kernel."""
    fetches = tl.sum(fetched.to(tl.int32), axis=0)
    order = tl.cumsum(fetched.to(tl.int32), axis=0) - 1
    victims = tl.full((K,), -1, tl.int64)
    if fetches > 0:
        idx = tl.arange(0, BLOCK_S)
        vals = tl.load(stamp_ptr + idx, mask=idx < S, other=2**62)
        j = tl.full([], 0, tl.int32)  # a while loop: the interpreter ranges over constants only
        while j < fetches:
            v = tl.argmin(vals, axis=0).to(tl.int64)
            victims = tl.where(fetched & (order == j), v, victims)
            vals = tl.where(idx == v, 2**62, vals)
            j += 1
    return victims


@triton.jit
def _count(counts_ptr, hit, miss, fetched, old):
    """The layer's hits, misses, evictions and fetches, added to its counters."""
    m = tl.sum(miss.to(tl.int32), axis=0)
    layer_counts = counts_ptr + tl.arange(0, 4)
    add = tl.where(
        tl.arange(0, 4) == 0,
        tl.sum(hit.to(tl.int64), axis=0),
        tl.where(
            tl.arange(0, 4) == 1,
            m.to(tl.int64),
            tl.where(
                tl.arange(0, 4) == 2,
                tl.sum((fetched & (old >= 0)).to(tl.int64), axis=0),
                tl.sum(fetched.to(tl.int64), axis=0),
            ),
        ),
    )
    tl.store(layer_counts, tl.load(layer_counts) + add)
