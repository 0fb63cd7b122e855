//! The process's allocator: mimalloc, except that inside
//! [`giving_back`] a block of at least [`GIVE_BACK_FROM`] bytes that is
//! freed, or moved by a `realloc`, has its pages given back to the system
//! at once.
//!
//! A shard's per-connection tables (the clients and parked-connection
//! slabs, the client-identifier index, the keep-alive deadline heap,
//! glommio's cancel queue) grow by doubling, and each growth frees the old
//! block after writing all of it. mimalloc keeps a freed block's memory
//! resident while any other block of its page lives (pages of 64 KiB –
//! 4 MiB hold several blocks of 10 KiB – 512 KiB), so those old
//! generations stayed in RSS. With `--shards 2` each table is half the
//! size, more of them sit in shared pages, and an idle broker kept
//! 0.08 KiB more per connection than with one shard (perf/RESULTS.md,
//! 2026-12-02, sessions 12 and 13). Such growth is rare (a doubling) and
//! already copies the block, so one `madvise` per growth costs nothing
//! measurable.
//!
//! Only inside [`giving_back`]: the hot path's buffers (a subscriber's
//! write buffer, a session's queue) also grow past 32 KiB and are freed
//! and grown again thousands of times a second under load, and each give
//! back would cost a system call and the page faults of touching the
//! pages again (measured: 6,000 `madvise` a second in fan-in, and lower
//! throughput, when every large `realloc` gave back).
//!
//! Inside [`aside`], blocks come from a second mimalloc heap (each thread
//! its own part of it), kept for what a connection holds only while it is
//! awake: its task ([`spawn_aside`]; what the task allocates as it runs
//! is not aside), its glommio stream with the poll of its socket, the
//! bytes waiting to be written, and the hand-off that carries it to its
//! home shard. A burst of connections makes thousands of these, and they
//! are freed when the connections park: an idle broker's aside heap holds
//! no block (checked with `mi_theap_visit_blocks` in a temporary build,
//! perf/RESULTS.md, 2026-12-02, session 16). Mixed with the
//! shard's long-lived blocks of the same sizes (glommio's timer and accept
//! sources, the sessions), the burst left whole mimalloc pages resident for
//! the few long-lived blocks among them; apart, the burst's pages empty
//! completely and go back to the system ([`collect`]). Measured: an idle
//! connection 3 % smaller (perf/RESULTS.md, 2026-12-02, session 16).
//!
//! The aside heap has an arena of its own ([`ASIDE_ARENA_BYTES`]): the
//! pages it frees when a burst parks are not taken by the main heap while
//! still resident (mimalloc purges a freed page only after
//! `MIMALLOC_PURGE_DELAY`, 1 s); a main-heap page made from one kept the
//! old contents resident past its blocks for as long as it lived. Measured:
//! `--shards 2` against `--shards 1` for an idle connection from 1.030 to
//! 1.011 (perf/RESULTS.md, 2026-12-02, session 17).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use mimalloc::MiMalloc;

/// Inside [`giving_back`], a block at least this large (bytes) that is
/// freed or moved has its pages given back.
pub const GIVE_BACK_FROM: usize = 32 << 10;

/// mimalloc with large freed blocks given back inside [`giving_back`]
/// (see the module docs). Install it with `#[global_allocator]`.
pub struct Allocator;

thread_local! {
    /// Whether this thread is inside [`giving_back`].
    static GIVING_BACK: Cell<bool> = const { Cell::new(false) };
    /// Inside [`aside`]: this thread's part of the aside heap; null
    /// elsewhere.
    static ASIDE: Cell<*mut Theap> = const { Cell::new(std::ptr::null_mut()) };
    /// This thread's part of the aside heap, once it has used it.
    static ASIDE_THEAP: Cell<*mut Theap> = const { Cell::new(std::ptr::null_mut()) };
}

/// mimalloc's `mi_theap_t` (v3): one thread's part of a heap.
#[repr(C)]
struct Theap {
    _opaque: [u8; 0],
}

// mimalloc v3's thread-local heap API (`mimalloc.h`), not bound by
// libmimalloc-sys; the symbols are in the library it builds.
extern "C" {
    fn mi_heap_theap(heap: *mut libmimalloc_sys::mi_heap_t) -> *mut Theap;
    fn mi_theap_malloc_aligned(theap: *mut Theap, size: usize, alignment: usize) -> *mut u8;
    fn mi_theap_collect(theap: *mut Theap, force: bool);
    fn mi_reserve_os_memory_ex(
        size: usize,
        commit: bool,
        allow_large: bool,
        exclusive: bool,
        arena_id: *mut *mut std::ffi::c_void,
    ) -> std::ffi::c_int;
    fn mi_heap_new_in_arena(arena_id: *mut std::ffi::c_void) -> *mut libmimalloc_sys::mi_heap_t;
    #[cfg(test)]
    fn mi_arena_contains(arena_id: *mut std::ffi::c_void, p: *const std::ffi::c_void) -> bool;
}

/// Virtual bytes reserved for the aside heap's own arena (mapped, touched
/// only as used); an aside block the arena cannot hold comes from the main
/// heap instead ([`Allocator`]).
pub const ASIDE_ARENA_BYTES: usize = 256 << 20;

/// The aside heap, made on first use (null if mimalloc could not), in an
/// arena of its own ([`ASIDE_ARENA_BYTES`]) when mimalloc can reserve one.
///
/// Its own arena, so that the pages a burst of connections frees when they
/// park are never taken by the main heap before mimalloc purges them
/// (`MIMALLOC_PURGE_DELAY`, 1 s): a main-heap page made from such memory
/// keeps it resident past the blocks it has handed out, for as long as the
/// page lives (perf/RESULTS.md, 2026-12-02, session 17).
fn aside_heap() -> *mut libmimalloc_sys::mi_heap_t {
    aside_heap_and_arena().0 as *mut _
}

/// The aside heap and its arena's id (0 if it has none), as addresses
/// (`usize`: `OnceLock` needs `Sync`).
fn aside_heap_and_arena() -> (usize, usize) {
    static HEAP: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *HEAP.get_or_init(|| {
        let mut arena: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: mimalloc reserves (maps, untouched) memory for an arena
        // only heaps made in it use, and writes its id.
        let reserved = unsafe { mi_reserve_os_memory_ex(ASIDE_ARENA_BYTES, true, false, true, &mut arena) };
        // SAFETY: only allocates inside mimalloc.
        unsafe {
            if reserved == 0 && !arena.is_null() {
                (mi_heap_new_in_arena(arena) as usize, arena as usize)
            } else {
                (libmimalloc_sys::mi_heap_new() as usize, 0)
            }
        }
    })
}

/// This thread's part of the aside heap (null if there is none).
fn aside_theap() -> *mut Theap {
    ASIDE_THEAP.with(|cached| {
        if cached.get().is_null() {
            let heap = aside_heap();
            if !heap.is_null() {
                // SAFETY: a live heap; mimalloc makes this thread's part.
                cached.set(unsafe { mi_heap_theap(heap) });
            }
        }
        cached.get()
    })
}

/// The aside heap, all threads' parts (for `census`).
#[cfg(feature = "heap-census")]
pub(crate) fn aside_heap_ptr() -> *mut std::ffi::c_void {
    aside_heap() as *mut std::ffi::c_void
}

/// This thread's part of the aside heap, if it has used it (for
/// `census`).
#[cfg(feature = "heap-census")]
pub(crate) fn aside_theap_ptr() -> *const std::ffi::c_void {
    ASIDE_THEAP.with(Cell::get) as *const std::ffi::c_void
}

/// Run `f` with the blocks it allocates taken from this thread's part of
/// the aside heap (see the module docs): for short-lived blocks made in
/// bursts, so that their pages empty together. Frees and `realloc`s work
/// as anywhere (a `realloc` may move the block back to the main heap).
pub fn aside<R>(f: impl FnOnce() -> R) -> R {
    with_aside(aside_theap(), f)
}

/// Run `f` with `theap` as this thread's aside heap (null: none), then
/// restore the previous one, also when `f` unwinds.
fn with_aside<R>(theap: *mut Theap, f: impl FnOnce() -> R) -> R {
    /// Restores the previous heap on drop.
    struct Restore(*mut Theap);
    impl Drop for Restore {
        fn drop(&mut self) {
            ASIDE.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(ASIDE.with(|a| a.replace(theap)));
    f()
}

/// Run `f` with the blocks it allocates taken from the main heap, also
/// inside [`aside`].
pub fn outside<R>(f: impl FnOnce() -> R) -> R {
    with_aside(std::ptr::null_mut(), f)
}

/// A future polled [`outside`] the aside heap (see [`spawn_aside`]).
struct Outside<F> {
    future: F,
}

impl<F: std::future::Future> std::future::Future for Outside<F> {
    type Output = F::Output;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        // SAFETY: structural pinning: the inner future is never moved
        // out of `self`, nor is `self` unpinned.
        let future = unsafe { self.map_unchecked_mut(|p| &mut p.future) };
        outside(|| future.poll(cx))
    }
}

/// Spawn `future` as a detached glommio task of this thread whose own
/// block (the task with the future's state) is made [`aside`], while all
/// it allocates as it runs comes from the main heap: glommio may run a new
/// task at once, inside the caller's scope, and a connection's first poll
/// makes blocks that live as long as its session.
pub fn spawn_aside(future: impl std::future::Future<Output = ()> + 'static) {
    let future = Outside { future };
    aside(|| glommio::spawn_local(future).detach());
}

/// Let mimalloc finish the frees other threads handed to this thread, free
/// its empty pages and purge what is due, in the main heap and in this
/// thread's part of the aside heap. `force`: also the empty pages kept for
/// reuse, and purge without waiting (`MIMALLOC_PURGE_DELAY`); it walks
/// every page this thread owns.
pub fn collect(force: bool) {
    // SAFETY: plain calls into the allocator for this thread's heaps.
    unsafe { libmimalloc_sys::mi_collect(force) };
    let theap = ASIDE_THEAP.with(Cell::get);
    if !theap.is_null() {
        // SAFETY: this thread's own part of the live aside heap.
        unsafe { mi_theap_collect(theap, force) };
    }
}

/// Run `f` with the large blocks it frees or moves given back to the
/// system (at least [`GIVE_BACK_FROM`] bytes, whole pages only). For code
/// that grows a long-lived table: the old block will not be reused soon.
pub fn giving_back<R>(f: impl FnOnce() -> R) -> R {
    /// Restores the flag, also when `f` unwinds.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GIVING_BACK.with(|g| g.set(self.0));
        }
    }
    let _restore = Restore(GIVING_BACK.with(|g| g.replace(true)));
    f()
}

/// Whether a block of `len` bytes freed now is given back.
#[inline]
fn gives_back(len: usize) -> bool {
    len >= GIVE_BACK_FROM && GIVING_BACK.with(Cell::get)
}

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
        let aside = ASIDE.with(Cell::get);
        if !aside.is_null() {
            // SAFETY: this thread's part of the live aside heap; mimalloc
            // takes any size and power-of-two alignment.
            let block = unsafe { mi_theap_malloc_aligned(aside, layout.size(), layout.align()) };
            if !block.is_null() {
                return block;
            }
            // The aside arena cannot hold it: the main heap instead.
        }
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
        if gives_back(layout.size()) {
            // SAFETY: the caller frees the block: its contents are done.
            unsafe { give_back(ptr, layout.size()) };
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !gives_back(layout.size()) {
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
    use std::future::Future;

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

    /// Allocate two 256 KiB blocks (the second keeps their page alive),
    /// fill the first and return it with the range of its whole pages.
    fn written_block(layout: Layout) -> (*mut u8, *mut u8, (usize, usize)) {
        let neighbour = unsafe { Allocator.alloc(layout) };
        let block = unsafe { Allocator.alloc(layout) };
        assert!(!block.is_null() && !neighbour.is_null());
        for i in 0..layout.size() {
            unsafe { *block.add(i) = (i % 251) as u8 };
        }
        let pages = whole_pages(block as usize, layout.size(), page_size()).unwrap();
        assert_eq!(
            resident_pages(pages.0, pages.1),
            pages.1 / page_size(),
            "written pages are resident"
        );
        (block, neighbour, pages)
    }

    /// Grow `block` to twice its size, inside [`giving_back`] or not, and
    /// return how many pages of its old range stayed resident, of how many.
    fn grow_and_count(give_back: bool) -> (usize, usize) {
        let layout = Layout::from_size_align(256 << 10, 8).unwrap();
        let (old, neighbour, (start, len)) = written_block(layout);
        let grow = || unsafe { Allocator.realloc(old, layout, 2 * layout.size()) };
        let new = if give_back { giving_back(grow) } else { grow() };
        assert!(!new.is_null());
        assert_ne!(new, old, "doubling a 256 KiB block moves it");
        for i in 0..layout.size() {
            assert_eq!(unsafe { *new.add(i) }, (i % 251) as u8, "byte {i}");
        }
        let resident = resident_pages(start, len);
        unsafe {
            Allocator.dealloc(new, Layout::from_size_align(2 * layout.size(), 8).unwrap());
            Allocator.dealloc(neighbour, layout);
        }
        (resident, len / page_size())
    }

    #[test]
    fn a_table_grown_inside_giving_back_gives_its_old_pages_back() {
        assert_eq!(grow_and_count(true).0, 0);
    }

    #[test]
    fn elsewhere_a_moved_block_stays_as_mimalloc_leaves_it() {
        // The hot path's buffers: no system call, the pages stay.
        let (resident, pages) = grow_and_count(false);
        assert_eq!(resident, pages);
    }

    #[test]
    fn a_block_freed_inside_giving_back_gives_its_pages_back() {
        let layout = Layout::from_size_align(256 << 10, 8).unwrap();
        let (block, neighbour, (start, len)) = written_block(layout);
        giving_back(|| unsafe { Allocator.dealloc(block, layout) });
        assert_eq!(resident_pages(start, len), 0);
        unsafe { Allocator.dealloc(neighbour, layout) };
    }

    #[test]
    fn giving_back_ends_with_its_scope_even_on_a_panic() {
        assert!(!gives_back(GIVE_BACK_FROM));
        giving_back(|| assert!(gives_back(GIVE_BACK_FROM) && !gives_back(GIVE_BACK_FROM - 1)));
        assert!(!gives_back(GIVE_BACK_FROM));
        let _ = std::panic::catch_unwind(|| giving_back(|| panic!("inside")));
        assert!(!gives_back(GIVE_BACK_FROM));
    }

    #[test]
    fn a_small_shrink_stays_in_place() {
        let layout = Layout::from_size_align(64 << 10, 8).unwrap();
        let p = unsafe { Allocator.alloc(layout) };
        let q = giving_back(|| unsafe { Allocator.realloc(p, layout, 48 << 10) });
        assert_eq!(p, q);
        unsafe { Allocator.dealloc(q, Layout::from_size_align(48 << 10, 8).unwrap()) };
    }

    #[test]
    fn whole_pages_skip_the_first_word_and_partial_pages() {
        for (ptr, want) in [
            (0x10000, (0x11000, 0x2000)),
            (0x10010, (0x11000, 0x2000)),
            (0x10ff0, (0x11000, 0x2000)),
            (0x10ff8, (0x12000, 0x1000)),
        ] {
            assert_eq!(
                whole_pages(ptr, 0x3000, 0x1000),
                Some(want),
                "block at {ptr:#x}"
            );
        }
        assert_eq!(whole_pages(0x10000, 0x1fff, 0x1000), None);
    }

    /// A burst of 448-byte blocks, one in 32 of them long-lived and made
    /// outside [`aside`], the rest made inside it or not; the rest freed
    /// and [`collect`]ed: how many of the pages the freed blocks were on
    /// are still resident, of how many.
    fn burst_pages_left(inside: bool) -> (usize, usize) {
        let layout = Layout::from_size_align(448, 8).unwrap();
        let mut kept = Vec::new();
        let mut freed = Vec::new();
        for i in 0..8192 {
            let p = if i % 32 == 0 {
                let p = unsafe { Allocator.alloc(layout) };
                kept.push(p);
                p
            } else {
                let make = || unsafe { Allocator.alloc(layout) };
                let p = if inside { aside(make) } else { make() };
                freed.push(p);
                p
            };
            assert!(!p.is_null());
            unsafe { std::ptr::write_bytes(p, 0xa5, layout.size()) };
        }
        let page = page_size();
        let mut pages: Vec<usize> = freed
            .iter()
            .flat_map(|&p| [p as usize / page, (p as usize + layout.size() - 1) / page])
            .collect();
        pages.sort_unstable();
        pages.dedup();
        // Pages a long-lived block sits on stay, whichever heap.
        let pinned: std::collections::HashSet<usize> = kept
            .iter()
            .flat_map(|&p| [p as usize / page, (p as usize + layout.size() - 1) / page])
            .collect();
        pages.retain(|p| !pinned.contains(p));
        for p in freed {
            unsafe { Allocator.dealloc(p, layout) };
        }
        collect(true);
        let resident = pages.iter().filter(|&&p| resident_pages(p * page, page) == 1).count();
        for p in kept {
            unsafe { Allocator.dealloc(p, layout) };
        }
        (resident, pages.len())
    }

    #[test]
    fn a_burst_made_aside_gives_its_pages_back_when_freed() {
        let (resident, pages) = burst_pages_left(true);
        assert!(pages > 50, "the burst spans {pages} pages");
        assert!(resident * 10 <= pages, "{resident} of {pages} pages still resident");
    }

    #[test]
    fn a_burst_mixed_with_long_lived_blocks_stays_resident() {
        // Why `aside` exists: the long-lived blocks pin the burst's
        // mimalloc pages, so the freed blocks' memory stays.
        let (resident, pages) = burst_pages_left(false);
        assert!(resident * 2 >= pages, "only {resident} of {pages} pages resident");
    }

    #[test]
    fn a_future_spawned_aside_runs_outside_it() {
        let seen = aside(|| {
            let mut future = std::pin::pin!(Outside { future: async { !ASIDE.with(Cell::get).is_null() } });
            let waker = std::task::Waker::noop();
            future.as_mut().poll(&mut std::task::Context::from_waker(waker))
        });
        assert_eq!(seen, std::task::Poll::Ready(false));
        assert!(outside(|| ASIDE.with(Cell::get).is_null()));
        aside(|| outside(|| ()));
        assert!(ASIDE.with(Cell::get).is_null());
    }

    #[test]
    fn aside_blocks_come_from_the_aside_arena_and_no_other_does() {
        let arena = aside_heap_and_arena().1 as *mut std::ffi::c_void;
        assert!(!arena.is_null(), "no arena of its own for the aside heap");
        let inside = |p: *mut u8| unsafe { mi_arena_contains(arena, p.cast()) };
        // Sizes of every kind of mimalloc page: small, medium, large.
        for size in [16, 160, 512, 4 << 10, 100 << 10, 2 << 20] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            let aside_block = aside(|| unsafe { Allocator.alloc(layout) });
            let main_block = unsafe { Allocator.alloc(layout) };
            assert!(!aside_block.is_null() && !main_block.is_null());
            assert!(inside(aside_block), "{size} B aside");
            assert!(!inside(main_block), "{size} B in the main heap");
            unsafe {
                Allocator.dealloc(aside_block, layout);
                Allocator.dealloc(main_block, layout);
            }
        }
    }

    #[test]
    fn an_aside_block_larger_than_the_aside_arena_comes_from_the_main_heap() {
        let arena = aside_heap_and_arena().1 as *mut std::ffi::c_void;
        let layout = Layout::from_size_align(ASIDE_ARENA_BYTES + (1 << 20), 8).unwrap();
        let block = aside(|| unsafe { Allocator.alloc(layout) });
        assert!(!block.is_null(), "no block");
        // SAFETY: a live block of this length; only its two ends are
        // touched.
        unsafe {
            assert!(!mi_arena_contains(arena, block.cast()));
            block.write(7);
            block.add(layout.size() - 1).write(9);
            assert_eq!((block.read(), block.add(layout.size() - 1).read()), (7, 9));
            Allocator.dealloc(block, layout);
        }
    }

    #[test]
    fn aside_ends_with_its_scope_even_on_a_panic() {
        assert!(ASIDE.with(Cell::get).is_null());
        aside(|| assert!(!ASIDE.with(Cell::get).is_null()));
        assert!(ASIDE.with(Cell::get).is_null());
        let _ = std::panic::catch_unwind(|| aside(|| panic!("inside")));
        assert!(ASIDE.with(Cell::get).is_null());
    }

    proptest! {
        /// A chain of reallocations of one block keeps its leading bytes,
        /// whichever path each step takes.
        #[test]
        fn realloc_chains_keep_the_bytes(sizes in proptest::collection::vec(1usize..(1 << 20), 1..12), align_log in 0u32..7, inside in any::<bool>()) {
            let align = 1usize << align_log;
            let mut len = sizes[0];
            let mut p = unsafe { Allocator.alloc(Layout::from_size_align(len, align).unwrap()) };
            prop_assert!(!p.is_null());
            for i in 0..len {
                unsafe { *p.add(i) = (i % 253) as u8 };
            }
            for &next in &sizes[1..] {
                let grow = || unsafe { Allocator.realloc(p, Layout::from_size_align(len, align).unwrap(), next) };
                let q = if inside { giving_back(grow) } else { grow() };
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

