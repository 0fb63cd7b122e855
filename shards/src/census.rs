//! A census of the shards' mimalloc heaps, for finding where an idle
//! broker's memory goes (built only with the `heap-census` feature; see
//! `perf/heap-census.sh`).
//!
//! With `FLEETMQ_HEAP_CENSUS=S1,S2,...` set, each shard, once each `S`
//! seconds after it started, walks the pages of its own part of the main
//! heap and of the aside heap ([`crate::alloc::aside`]) and prints one
//! line per block size to stderr: pages, live blocks, live bytes,
//! committed bytes, the bytes resident (`mincore`), and the resident bytes
//! of a page past what it has committed to blocks ("beyond": memory the
//! page was made from, resident from an earlier use). Shard 0 also walks
//! the whole main heap (every thread's pages), and counts the resident
//! memory of its arena that no page of either heap covers ("outside":
//! mimalloc's bitmaps, freed memory not purged yet). Its own walk runs
//! between the shard's tasks; the whole-heap walk reads other shards'
//! pages as they run, so take the census while the broker is idle.

use std::ffi::c_void;
use std::io::Write;

/// mimalloc's `mi_heap_area_t` (v3 `mimalloc.h`): one page's blocks.
#[repr(C)]
struct Area {
    blocks: *mut c_void,
    reserved: usize,
    committed: usize,
    used: usize,
    block_size: usize,
    full_block_size: usize,
    reserved1: *mut c_void,
}

extern "C" {
    fn mi_theap_get_default() -> *mut c_void;
    fn mi_heap_main() -> *mut c_void;
    fn mi_debug_show_arenas();
    fn mi_heap_visit_blocks(
        heap: *mut c_void,
        visit_blocks: bool,
        visitor: extern "C" fn(*const c_void, *const Area, *mut c_void, usize, *mut c_void) -> bool,
        arg: *mut c_void,
    ) -> bool;
    fn mi_heap_visit_abandoned_blocks(
        heap: *mut c_void,
        visit_blocks: bool,
        visitor: extern "C" fn(*const c_void, *const Area, *mut c_void, usize, *mut c_void) -> bool,
        arg: *mut c_void,
    ) -> bool;
    fn mi_theap_visit_blocks(
        theap: *const c_void,
        visit_blocks: bool,
        visitor: extern "C" fn(*const c_void, *const Area, *mut c_void, usize, *mut c_void) -> bool,
        arg: *mut c_void,
    ) -> bool;
}

/// Figures for one block size (bytes).
#[derive(Default, Clone, Copy)]
struct Class {
    pages: usize,
    live: usize,
    live_bytes: usize,
    committed: usize,
    resident: usize,
    /// Resident bytes of the page past what it has committed to blocks.
    beyond: usize,
}

/// Tally per block size: the visitor's argument.
#[derive(Default)]
struct Tally {
    classes: std::collections::BTreeMap<usize, Class>,
    /// Each page's blocks: start and bytes reserved.
    areas: Vec<(usize, usize)>,
}

extern "C" fn visit(
    _heap: *const c_void,
    area: *const Area,
    block: *mut c_void,
    _size: usize,
    arg: *mut c_void,
) -> bool {
    // SAFETY: mimalloc passes a live area and our own `Tally`.
    let (area, tally) = unsafe { (&*area, &mut *(arg as *mut Tally)) };
    let class = tally.classes.entry(area.block_size).or_default();
    if block.is_null() {
        // Once per page, before its blocks.
        class.pages += 1;
        tally.areas.push((area.blocks as usize, area.reserved));
        class.committed += area.committed;
        class.resident += resident(area.blocks, area.committed);
        let page = 4096;
        let tail = (area.blocks as usize + area.committed).div_ceil(page) * page;
        let end = area.blocks as usize + area.reserved;
        if end > tail {
            class.beyond += resident(tail as *mut c_void, end - tail);
        }
    } else {
        class.live += 1;
        class.live_bytes += area.block_size;
    }
    true
}

/// Bytes mapped outside the allocator, so that the census does not
/// change what it counts.
struct Scratch {
    ptr: *mut u8,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> Scratch {
        // SAFETY: a fresh private anonymous mapping, unmapped on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(ptr != libc::MAP_FAILED, "census: mmap failed");
        Scratch { ptr: ptr as *mut u8, len }
    }
}

impl std::ops::Deref for Scratch {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped by `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes mapped by `new`, owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `new`.
        unsafe { libc::munmap(self.ptr as *mut c_void, self.len.max(1)) };
    }
}

/// Bytes of `[start, start + len)` resident in memory (`mincore`).
fn resident(start: *mut c_void, len: usize) -> usize {
    const PAGE: usize = 4096;
    let first = start as usize & !(PAGE - 1);
    let end = (start as usize + len).div_ceil(PAGE) * PAGE;
    if end <= first {
        return 0;
    }
    let mut vec = Scratch::new((end - first) / PAGE);
    // SAFETY: a range inside a mapping mimalloc made; mincore only reads
    // the page tables and writes `vec`, one byte per page.
    let rc = unsafe { libc::mincore(first as *mut c_void, end - first, vec.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    vec.iter().filter(|b| **b & 1 == 1).count() * PAGE
}

/// Walk `theap` and print its classes, labelled `shard` and `heap`.
fn walk(shard: usize, heap: &str, theap: *const c_void) {
    if theap.is_null() {
        return;
    }
    let mut tally = Tally::default();
    let arg = &mut tally as *mut Tally as *mut c_void;
    // SAFETY: live heaps; the visitor only reads.
    unsafe {
        match heap {
            "whole" => {
                mi_heap_visit_blocks(theap as *mut c_void, true, visit, arg);
            }
            "abandoned" => {
                mi_heap_visit_abandoned_blocks(theap as *mut c_void, true, visit, arg);
            }
            _ => {
                mi_theap_visit_blocks(theap, true, visit, arg);
            }
        }
    }
    let mut out = std::io::stderr().lock();
    let mut total = Class::default();
    for (size, c) in &tally.classes {
        print_class(&mut out, shard, heap, &format!("block={size}"), c);
        total.pages += c.pages;
        total.live += c.live;
        total.live_bytes += c.live_bytes;
        total.committed += c.committed;
        total.resident += c.resident;
        total.beyond += c.beyond;
    }
    print_class(&mut out, shard, heap, "total", &total);
    if heap == "whole" {
        // The main heap's pages first: `outside` finds the mapping to
        // count from the first; then the aside heap's (an arena of its
        // own), so that its pages count as covered wherever they are.
        let mut areas = tally.areas;
        areas.extend(aside_whole(&mut out, shard));
        outside(&mut out, &areas);
    }
}

/// Print the aside heap's pages and resident bytes (all threads); its
/// pages' blocks: start and bytes reserved.
fn aside_whole(out: &mut impl Write, shard: usize) -> Vec<(usize, usize)> {
    let mut aside = Tally::default();
    // SAFETY: a live heap; the visitor only reads.
    unsafe {
        mi_heap_visit_blocks(crate::alloc::aside_heap_ptr(), false, visit, &mut aside as *mut Tally as *mut c_void)
    };
    let (pages, resident): (usize, usize) =
        aside.classes.values().fold((0, 0), |(p, r), c| (p + c.pages, r + c.resident));
    let _ = writeln!(out, "census n={} shard={shard} heap=aside-whole pages={pages} resident_kib={}", nth(), resident / 1024);
    aside.areas
}

/// One census line: `what` (a block size, or the total) of `heap`.
fn print_class(out: &mut impl Write, shard: usize, heap: &str, what: &str, c: &Class) {
    let kib = |bytes: usize| bytes as f64 / 1024.0;
    let _ = writeln!(
        out,
        "census n={} shard={shard} heap={heap} {what} pages={} live={} live_kib={:.1} committed_kib={:.1} beyond_kib={:.1} resident_kib={:.1}",
        nth(),
        c.pages,
        c.live,
        kib(c.live_bytes),
        kib(c.committed),
        kib(c.beyond),
        kib(c.resident)
    );
}

/// Print the resident memory of the mapping holding the pages in `areas`
/// that no page's blocks cover, by 64 KiB slice.
fn outside(out: &mut impl Write, areas: &[(usize, usize)]) {
    let Some(&(probe, _)) = areas.first() else { return };
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let Some((lo, hi)) = maps.lines().find_map(|l| {
        let range = l.split_whitespace().next()?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
        (a <= probe && probe < b).then_some((a, b))
    }) else {
        return;
    };
    const PAGE: usize = 4096;
    const SLICE: usize = 64 << 10;
    let mut vec = Scratch::new((hi - lo) / PAGE);
    // SAFETY: a whole mapping of this process; mincore writes `vec`.
    if unsafe { libc::mincore(lo as *mut c_void, hi - lo, vec.as_mut_ptr()) } != 0 {
        return;
    }
    let mut covered = Scratch::new(vec.len());
    for &(start, reserved) in areas {
        let first = (start & !(SLICE - 1)).max(lo);
        let end = (start + reserved).min(hi);
        let mut p = first;
        while p < end {
            covered[(p - lo) / PAGE] = 1;
            p += PAGE;
        }
    }
    let mut by_slice = std::collections::BTreeMap::<usize, usize>::new();
    let mut total = 0;
    let mut resident_total = 0;
    for (i, b) in vec.iter().enumerate() {
        if b & 1 == 1 {
            resident_total += PAGE;
            if covered[i] == 0 {
                total += PAGE;
                *by_slice.entry(i * PAGE / SLICE).or_default() += PAGE;
            }
        }
    }
    let _ = writeln!(
        out,
        "census n={} outside resident_kib={} of mapping_resident_kib={} slices={:?}",
        nth(),
        total / 1024,
        resident_total / 1024,
        by_slice.iter().map(|(s, b)| (*s, b / 1024)).collect::<Vec<_>>()
    );
    // What the fully resident outside slices hold: non-zero words, and the
    // first few of them.
    for (slice, bytes) in &by_slice {
        if *bytes < SLICE {
            continue;
        }
        let start = lo + slice * SLICE;
        // SAFETY: a resident range of this process's arena mapping.
        let words = unsafe { std::slice::from_raw_parts(start as *const u64, SLICE / 8) };
        let count = words.iter().filter(|w| **w != 0).count();
        let first: Vec<(usize, u64)> = words
            .iter()
            .enumerate()
            .filter(|(_, w)| **w != 0)
            .map(|(i, w)| (i * 8, *w))
            .take(12)
            .collect();
        let _ = writeln!(
            out,
            "census n={} slice={slice} at={start:#x} nonzero_words={} first={:x?}",
            nth(),
            count,
            first
        );
    }
}

/// When the censuses are due, latest first: `FLEETMQ_HEAP_CENSUS`, a
/// comma-separated list of seconds after `start`.
pub(crate) fn due(start: std::time::Instant) -> Vec<std::time::Instant> {
    let list = std::env::var("FLEETMQ_HEAP_CENSUS").unwrap_or_default();
    let mut at: Vec<_> = list
        .split(',')
        .filter_map(|s| s.trim().parse::<f64>().ok())
        .map(|secs| start + std::time::Duration::from_secs_f64(secs))
        .collect();
    at.sort_by(|a, b| b.cmp(a));
    at
}

thread_local! {
    /// How many censuses this thread took before the current one.
    static NTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The number of the census being taken on this thread (from 0).
fn nth() -> usize {
    NTH.with(std::cell::Cell::get)
}

/// Print the census of this thread's heaps (see the module docs).
pub(crate) fn take(shard: usize) {
    let _next = Next;
    /// Counts the census once printed.
    struct Next;
    impl Drop for Next {
        fn drop(&mut self) {
            NTH.with(|n| n.set(n.get() + 1));
        }
    }
    // SAFETY: plain reads of this thread's heap pointers.
    walk(shard, "main", unsafe { mi_theap_get_default() });
    walk(shard, "aside", crate::alloc::aside_theap_ptr());
    if shard == 0 {
        // SAFETY: the process's main heap.
        let main = unsafe { mi_heap_main() };
        walk(shard, "whole", main);
        walk(shard, "abandoned", main);
        // SAFETY: prints the arenas' slice maps to stderr.
        unsafe { mi_debug_show_arenas() };
    }
}
