//! Growth of a shard's per-connection tables (the clients slab, the
//! parked-connection slab, the deadline heap) around mimalloc's large
//! pages.
//!
//! mimalloc (v3) puts blocks of 64–512 KiB several to a 4 MiB page, and a
//! freed block stays resident while any other block of its page lives.
//! A table that doubles through that range leaves its old, fully written
//! blocks there: with `--shards 2` each table is half the size, so more
//! of them sit in that range, and an idle broker kept up to 1 MB more
//! (perf/RESULTS.md, 2026-12-02, session 12). A table that passes 64 KiB
//! therefore grows straight past 512 KiB, into a page of its own, which
//! is purged when freed. Only what is written becomes resident, so the
//! skipped capacity costs address space, not memory.

/// Tables smaller than this (bytes) grow as usual.
const SHARED_FROM: usize = 64 << 10;
/// Blocks larger than this (bytes) get a mimalloc page of their own.
const OWN_PAGE_ABOVE: usize = 512 << 10;

/// How many elements to reserve beyond `len` before adding one to a table
/// of `capacity` elements of `elem` bytes, all `len` of them in use; 0
/// when the table's usual growth (doubling) is fine.
pub(crate) fn reserve_for_next(len: usize, capacity: usize, elem: usize) -> usize {
    if len < capacity || elem == 0 {
        return 0;
    }
    let doubled = capacity.max(4).saturating_mul(2).saturating_mul(elem);
    if doubled > SHARED_FROM && doubled <= OWN_PAGE_ABOVE {
        (OWN_PAGE_ABOVE / elem + 1).saturating_sub(len)
    } else {
        0
    }
}

/// The capacity (elements) a table of `len` elements of `elem` bytes may
/// shrink to: `len`, unless that lands in the shared range (then just
/// past it).
pub(crate) fn shrink_target(len: usize, elem: usize) -> usize {
    let bytes = len.saturating_mul(elem);
    if elem > 0 && bytes > SHARED_FROM && bytes <= OWN_PAGE_ABOVE {
        OWN_PAGE_ABOVE / elem + 1
    } else {
        len
    }
}

/// Make room in `slab` for one more entry, past the shared range if the
/// next growth would land in it.
pub(crate) fn reserve_slab<T>(slab: &mut slab::Slab<T>) {
    // With no vacant entry, the next key is the end of the slab.
    if slab.vacant_key() == slab.len() {
        // An entry is at least a `T` (slab's `Entry<T>` is private): the
        // count reserved then spans at least the bytes asked for.
        let extra = reserve_for_next(slab.len(), slab.capacity(), std::mem::size_of::<T>());
        if extra > 0 {
            slab.reserve(extra);
        }
    }
}

/// Make room in `heap` for one more entry, as [`reserve_slab`] does.
pub(crate) fn reserve_heap<T: Ord>(heap: &mut std::collections::BinaryHeap<T>) {
    let extra = reserve_for_next(heap.len(), heap.capacity(), std::mem::size_of::<T>());
    if extra > 0 {
        heap.reserve(extra);
    }
}

/// Give back `heap`'s spare capacity, short of the shared range.
pub(crate) fn shrink_heap<T: Ord>(heap: &mut std::collections::BinaryHeap<T>) {
    heap.shrink_to(shrink_target(heap.len(), std::mem::size_of::<T>()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_skip_the_shared_range() {
        // Small tables double as usual.
        assert_eq!(reserve_for_next(100, 100, 32), 0);
        // Not full: nothing to do.
        assert_eq!(reserve_for_next(1000, 4096, 32), 0);
        // 2,048 × 32 B = 64 KiB full: doubling would give 128 KiB, so it
        // goes past 512 KiB at once.
        let extra = reserve_for_next(2048, 2048, 32);
        assert!((2048 + extra) * 32 > OWN_PAGE_ABOVE, "{extra}");
        // Already past: doubling again is fine.
        assert_eq!(reserve_for_next(16_385, 16_385, 32), 0);
        assert_eq!(shrink_target(3000, 32), OWN_PAGE_ABOVE / 32 + 1);
        assert_eq!(shrink_target(100, 32), 100);
        assert_eq!(shrink_target(20_000, 32), 20_000);
    }

    #[test]
    fn a_slab_that_passes_64_kib_lands_past_512() {
        let mut slab: slab::Slab<[u8; 264]> = slab::Slab::new();
        let mut sizes = Vec::new();
        for _ in 0..3000 {
            reserve_slab(&mut slab);
            let before = slab.capacity();
            slab.insert([0; 264]);
            if slab.capacity() != before {
                sizes.push(slab.capacity() * 264);
            }
        }
        assert!(
            sizes
                .iter()
                .all(|&b| b <= SHARED_FROM || b > OWN_PAGE_ABOVE),
            "capacities in bytes: {sizes:?}"
        );
    }
}
