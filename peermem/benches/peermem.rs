//! `cargo bench -p p2p-rdma-peermem`: the host-side costs of the peer-memory layer.
//!
//! - registration-cache hit: the cost of `RegCache::get` when the range is cached (what every
//!   open of an already registered region pays instead of a registration);
//! - bounce copy stage: a provider's copy engine (`copy_out` of host memory, `pread` of a memfd
//!   when /dev/udmabuf exists) into a staging buffer, against a plain `memcpy` of the same
//!   size (the physical limit of this machine).
//!
//! Prints a table; asserts nothing. Numbers are medians of several rounds.

use std::hint::black_box;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use peermem::regcache::{Limits, RegCache};
use peermem::{DmaBufMemory, HostMemory, Provider};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn cache_hit() {
    let c: RegCache<u32, u64> = RegCache::new(Limits::default());
    for k in 0..64u32 {
        drop(c.get(&k, 0..(1 << 20), 1 << 30, |r: Range<u64>| {
            Ok::<_, std::io::Error>(r.end)
        }));
    }
    let n = 200_000u32;
    let rounds: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for i in 0..n {
                let l = c
                    .get(&(i % 64), 4096..8192, 1 << 30, |_| {
                        Ok::<_, std::io::Error>(0)
                    })
                    .unwrap();
                black_box(*l);
            }
            t.elapsed().as_nanos() as f64 / f64::from(n)
        })
        .collect();
    let s = c.stats();
    println!(
        "regcache hit (64 entries cached): {:.0} ns per get+release (hits {}, misses {})",
        median(rounds),
        s.hits,
        s.misses
    );
}

fn gib_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / f64::from(1u32 << 30)
}

fn copy_stage() {
    println!(
        "{:>8}  {:>12}  {:>14}  {:>7}  {:>16}  {:>7}",
        "size", "memcpy GiB/s", "host copy_out", "ratio", "memfd pread", "ratio"
    );
    for size in [64usize << 10, 1 << 20, 16 << 20] {
        let total = 512usize << 20;
        let iters = (total / size).max(4);
        let src = vec![0x5au8; size];
        let mut dst = vec![0u8; size];
        let host = HostMemory::anonymous(size as u64, false).unwrap();
        host.copy_in(0, &src).unwrap();
        let dmabuf = DmaBufMemory::udmabuf(size as u64).ok().map(Arc::new);
        if let Some(d) = &dmabuf {
            d.copy_in(0, &src).unwrap();
        }
        let run = |f: &mut dyn FnMut(&mut [u8])| -> f64 {
            let mut dst = vec![0u8; size];
            median(
                (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        for _ in 0..iters {
                            f(&mut dst);
                            black_box(&dst);
                        }
                        gib_s(size * iters, t.elapsed().as_secs_f64())
                    })
                    .collect(),
            )
        };
        let memcpy = run(&mut |d| d.copy_from_slice(black_box(&src)));
        let host_bw = run(&mut |d| host.copy_out(0, d).unwrap());
        let (pread, pread_ratio) = match &dmabuf {
            Some(m) => {
                let bw = run(&mut |d| m.copy_out(0, d).unwrap());
                (format!("{bw:.2}"), format!("{:.2}", bw / memcpy))
            }
            None => ("no /dev/udmabuf".into(), "-".into()),
        };
        dst.copy_from_slice(&src);
        println!(
            "{:>8}  {:>12.2}  {:>14.2}  {:>7.2}  {:>16}  {:>7}",
            format!("{}K", size >> 10),
            memcpy,
            host_bw,
            host_bw / memcpy,
            pread,
            pread_ratio
        );
    }
}

fn main() {
    // `cargo test --benches` runs this binary too: keep that quick
    if std::env::args().any(|a| a == "--bench") {
        cache_hit();
        copy_stage();
    } else {
        println!("run with `cargo bench -p p2p-rdma-peermem`");
    }
}
