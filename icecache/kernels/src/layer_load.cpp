// The CPU bulk load of one layer step in one call: for every (row, KV head) unit, the residency update of its
// budget slots (icecache/runtime/loader.py `_assign_slots`, step for step: kept slots stay, freed slots are
// reused in ascending order by the new positions in selection order) and the copy of each new position's K and V
// row from its host store straight into the slot (the caller writes the slots' mask: its "scatter" stage). Rows
// are copied as bytes, so any element type works. Compiled for the x86-64 baseline; units run one after the other (a unit copies at most a
// budget of rows: threads would cost more than they save).
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
T* at(int64_t address) {
    return reinterpret_cast<T*>(address);
}

}  // namespace

extern "C" {

// units [n_units, 14] int64, one row per (row, KV head) u = b * H + h:
//   0 positions (int64 [n]), 1 n, 2 indptr (int64, CSR page offsets; 0 = none), 3 its length,
//   4 slot_of_pos (int64 [capacity], every position < capacity), 5 capacity,
//   6 the store's rows ([R, 2, dim] elements of elem_size bytes: K then V), 7 R,
//   8 page_of (int64), 9 its length, 10 slot_of (int64), 11 block_of (int64: page id -> block), 12 its length,
//   13 page_size.
// slot_pos [n_units, budget] int64 (-1 = free); keys / values: the layer's buffers [n_units, slots, dim] (bytes);
// the budget region is slots [region_start, region_start + budget).
// stats [n_units, 3]: pages selected, pages whose every token was resident, rows copied.
// Returns 0, or -1 - u when unit u's selection does not fit its budget, or -1000000 - u when one of its positions
// has no host row (the caller raises; the units before u are done, u itself is partly updated, as in numba).
int64_t ice_layer_load(int64_t n_units, const int64_t* units, int64_t* slot_pos, int64_t budget, uint8_t* keys,
                       uint8_t* values, int64_t slots, int64_t region_start, int64_t dim, int64_t elem_size,
                       int64_t* stats) {
    thread_local std::vector<char> kept, keep_slot;
    const int64_t row_bytes = dim * elem_size;
    for (int64_t u = 0; u < n_units; ++u) {
        const int64_t* d = units + 14 * u;
        const int64_t* pos = at<const int64_t>(d[0]);
        const int64_t n = d[1];
        const int64_t* indptr = at<const int64_t>(d[2]);
        const int64_t indptr_len = d[3];
        int64_t* sop = at<int64_t>(d[4]);
        const uint8_t* rows = at<const uint8_t>(d[6]);
        const int64_t num_rows = d[7];
        const int64_t* page_of = at<const int64_t>(d[8]);
        const int64_t page_of_len = d[9];
        const int64_t* slot_of = at<const int64_t>(d[10]);
        const int64_t* block_of = at<const int64_t>(d[11]);
        const int64_t block_of_len = d[12];
        const int64_t page_size = d[13];
        int64_t* sp = slot_pos + u * budget;
        kept.assign(n, 0);
        keep_slot.assign(budget, 0);
        int64_t n_new = 0;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t sl = sop[pos[i]];
            kept[i] = sl >= 0;
            if (sl >= 0) keep_slot[sl] = 1;
            else ++n_new;
        }
        int64_t pages = 0, reused = 0;
        if (indptr_len > 1 && n > 0) {
            pages = indptr_len - 1;
            for (int64_t p = 0; p < pages; ++p) {
                bool whole = true;
                for (int64_t i = indptr[p]; i < indptr[p + 1]; ++i)
                    if (!kept[i]) {
                        whole = false;
                        break;
                    }
                reused += whole;
            }
        }
        for (int64_t sl = 0; sl < budget; ++sl)
            if (!keep_slot[sl] && sp[sl] >= 0) {
                sop[sp[sl]] = -1;
                sp[sl] = -1;
            }
        int64_t sl = 0;
        const int64_t base = u * slots + region_start;
        for (int64_t i = 0; i < n; ++i) {
            if (kept[i]) continue;
            while (sl < budget && sp[sl] >= 0) ++sl;
            if (sl == budget) return -1 - u;
            const int64_t p = pos[i];
            const int64_t page = p >= 0 && p < page_of_len ? page_of[p] : -1;
            const int64_t block = page >= 0 && page < block_of_len ? block_of[page] : -1;
            const int64_t row = block >= 0 ? block * page_size + slot_of[p] : -1;
            if (row < 0 || row >= num_rows) return -1000000 - u;
            sp[sl] = p;
            sop[p] = sl;
            std::memcpy(keys + (base + sl) * row_bytes, rows + (2 * row) * row_bytes, row_bytes);
            std::memcpy(values + (base + sl) * row_bytes, rows + (2 * row + 1) * row_bytes, row_bytes);
        }
        stats[3 * u] = pages;
        stats[3 * u + 1] = reused;
        stats[3 * u + 2] = n_new;
    }
    return 0;
}

}  // extern "C"
