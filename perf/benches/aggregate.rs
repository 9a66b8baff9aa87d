//! The aggregation loop against plain slice loops, in the same run.
//!
//! `cargo bench -p kvstore-perf --bench aggregate`: compare the throughput of
//! `kvstore_sum_4` with `plain_sum_4` (and `kvstore_add` with `plain_add`); their ratio is the
//! figure the README reports.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const N: usize = 1 << 20; // 4 MiB of f32 per array

/// The baseline: one pass, every input read once, written the obvious way.
fn plain_sum_4(out: &mut [f32], a: &[f32], b: &[f32], c: &[f32], d: &[f32]) {
    for i in 0..out.len() {
        out[i] = a[i] + b[i] + c[i] + d[i];
    }
}

fn plain_add(out: &mut [f32], a: &[f32]) {
    for i in 0..out.len() {
        out[i] += a[i];
    }
}

fn bench(c: &mut Criterion) {
    let inputs: Vec<Vec<f32>> = (0..4)
        .map(|k| (0..N).map(|i| (i + k) as f32).collect())
        .collect();
    let mut out = vec![0.0f32; N];
    let mut g = c.benchmark_group("sum of 4 x 4 MiB f32");
    g.throughput(Throughput::Bytes((5 * N * 4) as u64));
    g.bench_function(BenchmarkId::new("plain_sum_4", N), |bch| {
        bch.iter(|| {
            plain_sum_4(
                black_box(&mut out),
                &inputs[0],
                &inputs[1],
                &inputs[2],
                &inputs[3],
            )
        })
    });
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    g.bench_function(BenchmarkId::new("kvstore_sum_4", N), |bch| {
        bch.iter(|| kvstore::ops::sum_into(black_box(&mut out), &refs))
    });
    g.finish();
    let mut g = c.benchmark_group("add 4 MiB f32");
    g.throughput(Throughput::Bytes((3 * N * 4) as u64));
    g.bench_function("plain_add", |bch| {
        bch.iter(|| plain_add(black_box(&mut out), &inputs[0]))
    });
    g.bench_function("kvstore_add", |bch| {
        bch.iter(|| kvstore::ops::add_into(black_box(&mut out), &inputs[0]))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
