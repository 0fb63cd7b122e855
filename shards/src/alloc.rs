//! The process's allocator: mimalloc, except that a block of at least
//! [`GIVE_BACK_FROM`] bytes that a `realloc` moves has its pages given
//! back to the system as it is freed.
//!
//! A shard's per-connection tables (the clients and parked-connection
//! slabs, the keep-alive deadline heap, glommio's source list and cancel
//! queue) grow by doubling, and each growth frees the old block after
//! writing all of it. mimalloc keeps a freed block's memory resident
//! while any other block of its page lives (pages of 64 KiB – 4 MiB hold
//! several blocks of 10 KiB – 512 KiB), so those old generations stayed
//! in RSS. With `--shards 2` each table is half the size, more of them sit
//! in shared pages, and an idle broker kept 0.08 KiB more per connection
//! than with one shard (perf/RESULTS.md, 2026-12-02, sessions 12 and 13).
//! Growth of such a block is rare (a doubling) and already copies it, so
//! one `madvise` per growth costs nothing measurable; the hot path's
//! small blocks never take this path.
//!
//! Only `realloc` does this: a plain `dealloc` of a large block (a large
//! message's buffer) may be followed by an allocation of the same size,
//! which would fault the pages back in.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

use mimalloc::MiMalloc;

/// A moved block at least this large (bytes) has its pages given back.
pub const GIVE_BACK_FROM: usize = 32 << 10;

/// mimalloc with large moved blocks given back (see the module docs).
/// Install it with `#[global_allocator]`.
pub struct Allocator;

/// The system's page size (bytes), read once; 0 until then.
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);

fn page_size() -> usize {
    let page = PAGE_SIZE.load(Ordering::Relaxed);
    if page != 0 {
        return page;
    }
    // SAFETY: sysconf reads a constant of the system; it does not allocate.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096);
    PAGE_SIZE.store(page, Ordering::Relaxed);
    page
}

/// The whole pages of the block at `ptr` of `len` bytes that lie past its
/// first 16 bytes (where mimalloc links a free block), as
/// `(start, len)`; `None` when there is none.
fn whole_pages(ptr: usize, len: usize, page: usize) -> Option<(usize, usize)> {
    let start = (ptr + 16).next_multiple_of(page);
    let end = (ptr + len) / page * page;
    (end > start).then(|| (start, end - start))
}

/// Tell the system the whole pages of the block at `ptr` (`len` bytes)
/// are not needed: they read as zeroes if touched again.
///
/// # Safety
/// The block's contents must no longer be needed, and it must not be
/// freed yet.
unsafe fn give_back(ptr: *mut u8, len: usize) {
    if let Some((start, len)) = whole_pages(ptr as usize, len, page_size()) {
        // SAFETY: the range lies inside a block the caller owns and no
        // longer reads; MADV_DONTNEED on private anonymous memory only
        // drops its contents. A failure leaves the pages resident.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    }
}

// SAFETY: every method forwards to MiMalloc with the caller's layout;
// `realloc`'s own path allocates, copies `min(old, new)` bytes and frees,
// as `GlobalAlloc::realloc`'s default does.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { MiMalloc.alloc(layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { MiMalloc.alloc_zeroed(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < GIVE_BACK_FROM {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        }
        // SAFETY: `ptr` is a live block of this allocator.
        let usable = unsafe { libmimalloc_sys::mi_usable_size(ptr.cast()) };
        if new_size <= usable && new_size >= usable / 2 {
            // mimalloc's own rule for resizing in place.
            return ptr;
        }
        // SAFETY: `new_size` is non-zero and, rounded to the alignment,
        // does not overflow (the caller's guarantees for realloc).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: a non-zero size (above).
        let new = unsafe { MiMalloc.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live, distinct and at least this
            // long; the old one is given back after the copy and then
            // freed with its own layout.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                give_back(ptr, layout.size());
                MiMalloc.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// How many of the pages in `start..start + len` (page-aligned) are
    /// resident, by mincore(2).
    fn resident_pages(start: usize, len: usize) -> usize {
        let page = page_size();
        let mut vec = vec![0u8; len / page];
        // SAFETY: the range is mapped (inside a live mimalloc arena) and
        // `vec` has one byte per page.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn a_moved_large_block_keeps_its_bytes_and_gives_back_its_pages() {
        let old_len = 256 << 10;
        let layout = Layout::from_size_align(old_len, 8).unwrap();
        // Keep a neighbour alive so the old block's page is not freed whole.
        let neighbour = unsafe { Allocator.alloc(layout) };
        let old = unsafe { Allocator.alloc(layout) };
        assert!(!old.is_null() && !neighbour.is_null());
        for i in 0..old_len {
            unsafe { *old.add(i) = (i % 251) as u8 };
        }
        let (start, len) = whole_pages(old as usize, old_len, page_size()).unwrap();
        assert_eq!(resident_pages(start, len), len / page_size(), "written pages are resident");

        let new = unsafe { Allocator.realloc(old, layout, 2 * old_len) };
        assert!(!new.is_null());
        assert_ne!(new, old, "doubling a 256 KiB block moves it");
        for i in 0..old_len {
            assert_eq!(unsafe { *new.add(i) }, (i % 251) as u8, "byte {i}");
        }
        assert_eq!(resident_pages(start, len), 0, "the old block's pages were given back");

        unsafe {
            Allocator.dealloc(new, Layout::from_size_align(2 * old_len, 8).unwrap());
            Allocator.dealloc(neighbour, layout);
        }
    }

    #[test]
    fn a_small_shrink_stays_in_place() {
        let layout = Layout::from_size_align(64 << 10, 8).unwrap();
        let p = unsafe { Allocator.alloc(layout) };
        let q = unsafe { Allocator.realloc(p, layout, 48 << 10) };
        assert_eq!(p, q);
        unsafe { Allocator.dealloc(q, Layout::from_size_align(48 << 10, 8).unwrap()) };
    }

    #[test]
    fn whole_pages_skip_the_first_word_and_partial_pages() {
        assert_eq!(whole_pages(0x10000, 0x3000, 0x1000), Some((0x11000, 0x2000)));
        assert_eq!(whole_pages(0x10010, 0x3000, 0x1000), Some((0x11000, 0x2000)));
        assert_eq!(whole_pages(0x10ff0, 0x3000, 0x1000), Some((0x11000, 0x2000)));
        assert_eq!(whole_pages(0x10ff8, 0x3000, 0x1000), Some((0x12000, 0x1000)));
        assert_eq!(whole_pages(0x10000, 0x1fff, 0x1000), None);
    }

    proptest! {
        /// A chain of reallocations of one block keeps its leading bytes,
        /// whichever path each step takes.
        #[test]
        fn realloc_chains_keep_the_bytes(sizes in proptest::collection::vec(1usize..(1 << 20), 1..12), align_log in 0u32..7) {
            let align = 1usize << align_log;
            let mut len = sizes[0];
            let mut p = unsafe { Allocator.alloc(Layout::from_size_align(len, align).unwrap()) };
            prop_assert!(!p.is_null());
            for i in 0..len {
                unsafe { *p.add(i) = (i % 253) as u8 };
            }
            for &next in &sizes[1..] {
                let q = unsafe { Allocator.realloc(p, Layout::from_size_align(len, align).unwrap(), next) };
                prop_assert!(!q.is_null());
                prop_assert_eq!(q as usize % align, 0);
                let kept = len.min(next);
                for i in (0..kept).step_by(97).chain(kept.checked_sub(1)) {
                    prop_assert_eq!(unsafe { *q.add(i) }, (i % 253) as u8, "byte {} of {}", i, kept);
                }
                for i in kept..next {
                    unsafe { *q.add(i) = (i % 253) as u8 };
                }
                p = q;
                len = next;
            }
            unsafe { Allocator.dealloc(p, Layout::from_size_align(len, align).unwrap()) };
        }
    }
}
