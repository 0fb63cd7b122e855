//! Subscription trie and route table micro-benchmarks (DESIGN.md §3).
//!
//! - `trie_match/{exact,exact_plus,exact_hash}/{1000,100000,1000000}`: one
//!   `SubscriptionTrie::for_each_match` on a topic of a subscribed device,
//!   with that many subscriptions. Filters are `site{s}/dev{d}/temp`
//!   (1000 devices per site); in `exact_plus` every 10th (i % 10 == 9) is `+/dev{d}/temp`,
//!   in `exact_hash` every 10th (i % 10 == 9) is `site{s}/dev{d}/#`.
//! - `route_table/*`: `RouteTable` updates and lookups with 100000 filters
//!   already present.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion};
use fleetmq_core::route::RouteTable;
use fleetmq_core::trie::SubscriptionTrie;

/// Subscription counts measured.
const SIZES: [u32; 3] = [1_000, 100_000, 1_000_000];
/// Topics looked up, cycled through (a power of two).
const TOPICS: usize = 1024;

/// The filter mixes measured.
#[derive(Clone, Copy)]
enum Mix {
    Exact,
    ExactPlus,
    ExactHash,
}

impl Mix {
    fn name(self) -> &'static str {
        match self {
            Mix::Exact => "exact",
            Mix::ExactPlus => "exact_plus",
            Mix::ExactHash => "exact_hash",
        }
    }

    /// The filter of subscription `i`.
    fn filter(self, i: u32) -> String {
        let (site, dev) = (i / 1000, i);
        match self {
            Mix::ExactPlus if i % 10 == 9 => format!("+/dev{dev}/temp"),
            Mix::ExactHash if i % 10 == 9 => format!("site{site}/dev{dev}/#"),
            _ => format!("site{site}/dev{dev}/temp"),
        }
    }
}

/// A small deterministic generator (xorshift64), so runs compare.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % u64::from(n)) as u32
    }
}

/// Topics of `TOPICS` random devices among the first `n`.
fn device_topics(n: u32) -> Vec<String> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    (0..TOPICS)
        .map(|_| {
            let dev = rng.below(n);
            format!("site{}/dev{dev}/temp", dev / 1000)
        })
        .collect()
}

fn trie_match(c: &mut Criterion) {
    for mix in [Mix::Exact, Mix::ExactPlus, Mix::ExactHash] {
        let mut group = c.benchmark_group(format!("trie_match/{}", mix.name()));
        for n in SIZES {
            let mut trie = SubscriptionTrie::<u32, u8>::new();
            for i in 0..n {
                trie.insert(&mix.filter(i), i, 1);
            }
            let topics = device_topics(n);
            group.bench_function(BenchmarkId::from_parameter(n), |b| {
                let mut next = 0;
                b.iter(|| {
                    let topic = &topics[next % TOPICS];
                    next += 1;
                    let mut delivered = 0u32;
                    trie.for_each_match(black_box(topic), |_, qos| delivered += u32::from(*qos));
                    delivered
                })
            });
        }
        group.finish();
    }
}

fn route_table(c: &mut Criterion) {
    const FILTERS: u32 = 100_000;
    let mut table = RouteTable::new();
    for i in 0..FILTERS {
        table.add(&Mix::ExactPlus.filter(i), (i % 8) as usize);
    }
    let mut group = c.benchmark_group("route_table");
    // A filter no shard had: nodes are created, then pruned.
    group.bench_function("add_then_remove_new_filter", |b| {
        b.iter(|| {
            table.add(black_box("site7/dev-new/temp"), 3);
            table.remove(black_box("site7/dev-new/temp"), 3);
        })
    });
    // A second shard joins a filter that exists, then leaves it.
    group.bench_function("add_then_remove_second_shard", |b| {
        b.iter(|| {
            table.add(black_box("site7/dev7001/temp"), 9);
            table.remove(black_box("site7/dev7001/temp"), 9);
        })
    });
    let topics = device_topics(FILTERS);
    group.bench_function("shards_for", |b| {
        let mut next = 0;
        b.iter(|| {
            let topic = &topics[next % TOPICS];
            next += 1;
            table.shards_for(black_box(topic))
        })
    });
    group.finish();
}

/// What `criterion_main!` would generate, written out so that no
/// undocumented public function is generated.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    trie_match(&mut c);
    route_table(&mut c);
    c.final_summary();
}
